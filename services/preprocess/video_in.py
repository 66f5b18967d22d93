"""Video files in, through PyAV: the container's header is checked (bytes, codec, frame size, duration) and its
packets' timestamps read before anything is decoded; then only the frames Qwen's sampling keeps are converted to RGB,
turned as a player shows them, and the soundtrack, where it is heard, is decoded to mono at the model's rate as audio
files are."""

import io
import math
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import torch
from av.stream import Discard

from services.preprocess.audio_in import header_seconds, ffmpeg_words, to_mono
from services.preprocess.rotation import display_matrix, upright
from services.runtime.config import Limits
from services.runtime.errors import InvalidArgument, ResourceExhausted

EXPECTED = "MP4, MOV, MKV or WebM"
# FFmpeg's demuxers for them; no other is ever opened (a playlist demuxer would open the URLs it names).
DEMUXERS = "mov,mp4,matroska,webm"
CODECS = {"h264": "H.264", "hevc": "HEVC", "vp8": "VP8", "vp9": "VP9", "av1": "AV1"}
# qwen-omni-utils' FPS; transformers' Qwen2VLVideoProcessor min_frames and max_frames
SAMPLE_FPS, MIN_FRAMES, MAX_FRAMES = 2.0, 4, 768


@dataclass
class Clip:
    frames: np.ndarray  # [T, H, W, 3] uint8, the sampled frames
    fps: float  # rate of the sampled frames
    audio: np.ndarray | None  # the soundtrack: mono float32 at the model's rate; None: none asked for, or the file has none


def sample_count(total: int, seconds: float, fps: float, temporal: int) -> int:
    """How many of `total` frames spanning `seconds` are kept, as transformers' Qwen2VLVideoProcessor counts them."""
    most = math.floor(min(MAX_FRAMES, total) / temporal) * temporal
    n = min(max(seconds * fps, MIN_FRAMES), most, total)
    return math.floor(n / temporal) * temporal


def sample_indices(total: int, video_fps: float, fps: float, temporal: int) -> torch.Tensor:
    """Indices of the frames kept, as transformers' Qwen2VLVideoProcessor.sample_frames picks them."""
    n = sample_count(total, total / video_fps, fps, temporal)
    return torch.arange(0, total, total / n).int() if n else torch.zeros(0, dtype=torch.int32)


def sample_times(pts: np.ndarray, end: int, time_base: Fraction, average_rate, fps: float, temporal: int
                 ) -> tuple[np.ndarray, float]:
    """Indices into `pts` (a stream's presentation times, in display order, the last frame shown until `end`) of
    the frames kept, and the rate they are kept at. Frames evenly spaced at the container's rate are picked by index
    as transformers picks them; any other timeline by time: the frame on screen at each of evenly spaced instants."""
    total, span = len(pts), int(end - pts[0])
    gaps, rate = np.diff(pts), float(average_rate or 0)
    # timestamps round to their time base: a tick of jitter is still an even rate
    if len(gaps) and gaps.max() - gaps.min() <= 1 and abs(float(span * time_base) * rate / total - 1) < 0.01:
        keep = sample_indices(total, rate, fps, temporal).numpy()
        return keep, len(keep) / total * rate
    seconds = float(span * time_base)
    n = sample_count(total, seconds, fps, temporal)
    # frame i is on screen at instant k of n where n * (pts[i] - pts[0]) <= k * span: exact, in integers
    keep = np.searchsorted(n * (pts - pts[0]), np.arange(n, dtype=np.int64) * span, side="right") - 1
    return keep, n / seconds if n else 0.0


def decode_video(data: bytes, limits: Limits, where: str, fps: float, temporal: int, rate: int, check=None,
                 sound: bool = True) -> Clip:
    """A video file's first video stream, sampled at `fps` to a multiple of `temporal` frames, and with `sound` its
    first audio stream at `rate`; `check(width, height, frames)` raises for frames refused for other reasons (the
    context)."""
    if not data:
        raise InvalidArgument(f"{where}: empty video file")
    if len(data) > limits.max_request_bytes:
        raise ResourceExhausted(f"{where}: a video file of {len(data)} bytes is over the limit of {limits.max_request_bytes}")
    try:
        container = av.open(io.BytesIO(data), mode="r", options={"format_whitelist": DEMUXERS})
    except av.FFmpegError as e:
        raise InvalidArgument(f"{where}: cannot decode video ({EXPECTED} expected): {ffmpeg_words(e)}") from None
    with container:
        if not container.streams.video:
            raise InvalidArgument(f"{where}: the {container.format.long_name} file has no video stream")
        video = container.streams.video[0]
        codec = video.codec_context.codec.canonical_name
        if codec not in CODECS:
            raise InvalidArgument(f"{where}: video codec {codec} is not supported ({', '.join(CODECS.values())})")
        w, h = video.codec_context.width, video.codec_context.height
        if not w or not h:
            raise InvalidArgument(f"{where}: the video stream's header gives no frame size")
        if w * h > limits.max_image_pixels:
            raise ResourceExhausted(f"{where}: video frames of {w}x{h} = {w * h} pixels are over the limit of {limits.max_image_pixels}")
        seconds = header_seconds(container, video)
        if seconds is not None and seconds > limits.max_audio_seconds:
            raise ResourceExhausted(f"{where}: {seconds:.1f} s of video is over the limit of {limits.max_audio_seconds:.0f} s")
        audio = container.streams.audio[0] if sound and container.streams.audio else None
        for other in container.streams:
            if other is not video and other is not audio:
                other.discard = Discard.all  # the demuxer skips a soundtrack not heard: never read, never decoded
        video.codec_context.thread_count = 1  # one decoder thread per worker process, as for audio
        video.codec_context.options = {"err_detect": "explode"}  # damaged data is refused, not concealed
        packets, heard = _demux(container, video, audio, limits.max_audio_seconds, where)
        shown = np.sort(np.array([p.pts for p in packets if not p.is_discard], dtype=np.int64))
        end = _end(packets, shown)
        if seconds and float(end * video.time_base) < 0.9 * seconds - 0.5:  # headers round; a cut file stops well short
            raise InvalidArgument(f"{where}: the video file is truncated: its header says {seconds:.1f} s, "
                                  f"its frames stop at {float(end * video.time_base):.1f} s")
        if len(shown) > 1 and end <= shown[0]:
            raise InvalidArgument(f"{where}: the video's frames do not advance in time")
        keep, kept_fps = sample_times(shown, end, video.time_base, video.average_rate, fps, temporal) if len(shown) else ([], 0.0)
        if len(keep) == 0:
            raise InvalidArgument(f"{where}: a video needs at least {temporal} frames, the file has {len(shown)}")
        if len(keep) > limits.max_video_frames:
            raise ResourceExhausted(f"{where}: {len(keep)} frames sampled at {fps:g} fps is over the limit of {limits.max_video_frames}")
        if check is not None:
            check(w, h, len(keep))
        try:
            frames = _frames(video, packets, Counter(shown[keep].tolist()), (w, h), where)
            pcm = to_mono(_decoded(audio, heard), rate, limits.max_audio_seconds, where) if audio is not None else None
        except av.FFmpegError as e:
            raise InvalidArgument(f"{where}: cannot decode video: {ffmpeg_words(e)}") from None
    if len(frames) < len(keep):
        raise InvalidArgument(f"{where}: cannot decode video: {len(shown)} frames in the file, only {len(frames)} "
                              f"sampled ones decoded of {len(keep)}")
    return Clip(np.stack(frames), kept_fps, pcm)


def _end(packets, shown: np.ndarray) -> int:
    """When the last frame leaves the screen, in the stream's time base: its packet's duration, else the mean gap."""
    end = max((p.pts + (p.duration or 0) for p in packets), default=0)
    if len(shown) > 1 and end <= shown[-1]:
        end = shown[-1] + (shown[-1] - shown[0]) // (len(shown) - 1)
    return int(end)


def _demux(container, video, audio, max_seconds: float, where: str) -> tuple[list, list]:
    """Every packet of the two streams, read without decoding; refused once past `max_seconds` (a header that
    understates the length), unreadable data refused as corrupt."""
    packets, sound = [], []
    try:
        for packet in container.demux(*[s for s in (video, audio) if s is not None]):
            if packet.size == 0:  # the demuxer's end-of-stream marker
                continue
            if packet.pts is None and packet.stream is video:
                raise InvalidArgument(f"{where}: a frame of the video stream has no timestamp")
            if packet.pts is not None and packet.time_base and packet.pts * packet.time_base > max_seconds + 1:
                raise ResourceExhausted(f"{where}: more than {max_seconds:.0f} s of video is over the limit")
            (packets if packet.stream is video else sound).append(packet)
    except av.FFmpegError as e:
        raise InvalidArgument(f"{where}: cannot decode video: {ffmpeg_words(e)}") from None
    return packets, sound


def _decoded(stream, packets):
    for packet in [*packets, None]:  # None flushes the frames the decoder holds back
        yield from stream.codec_context.decode(packet)


def _frames(video, packets, keep: Counter, size: tuple[int, int], where: str) -> list[np.ndarray]:
    """The frames at the times `keep` counts (one frame may be on screen at two sampled instants) as RGB, turned as
    a player shows them; every frame checked to be the header's size."""
    out, turn = [], None
    for i, frame in enumerate(_decoded(video, packets)):
        if (frame.width, frame.height) != size:
            raise InvalidArgument(f"{where}: frame {i} is {frame.width}x{frame.height}, the stream's header says {size[0]}x{size[1]}")
        if i == 0:  # one orientation for the stream: frames of one size
            turn = display_matrix(frame, video.metadata)
        if keep[frame.pts]:
            out += [np.ascontiguousarray(upright(frame.to_ndarray(format="rgb24"), turn))] * keep.pop(frame.pts)
    return out

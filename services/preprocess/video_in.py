"""Video files in, through PyAV: the container's header is checked (bytes, codec, frame size, duration) and its
packets counted before anything is decoded; then only the frames Qwen's sampling keeps are converted to RGB, turned
as a player shows them, and the soundtrack, where it is heard, is decoded to mono at the model's rate as audio files
are."""

import io
import math
from dataclasses import dataclass

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


def sample_indices(total: int, video_fps: float, fps: float, temporal: int) -> torch.Tensor:
    """Indices of the frames kept, as transformers' Qwen2VLVideoProcessor.sample_frames picks them."""
    most = math.floor(min(MAX_FRAMES, total) / temporal) * temporal
    n = min(max(total / video_fps * fps, MIN_FRAMES), most, total)
    n = math.floor(n / temporal) * temporal
    return torch.arange(0, total, total / n).int() if n else torch.zeros(0, dtype=torch.int32)


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
        packets, sound = _demux(container, video, audio, limits.max_audio_seconds, where)
        end = max((float((p.pts + p.duration) * p.time_base) for p in packets if p.pts is not None), default=0.0)
        if seconds and end < 0.9 * seconds - 0.5:  # headers round; a cut file's packets stop well short of them
            raise InvalidArgument(f"{where}: the video file is truncated: its header says {seconds:.1f} s, "
                                  f"its frames stop at {end:.1f} s")
        video_fps = float(video.average_rate or 0) or (len(packets) / seconds if seconds else 0)
        if not video_fps:
            raise InvalidArgument(f"{where}: the video stream gives no frame rate")
        keep = sample_indices(len(packets), video_fps, fps, temporal)
        if len(keep) == 0:
            raise InvalidArgument(f"{where}: a video needs at least {temporal} frames, the file has {len(packets)}")
        if len(keep) > limits.max_video_frames:
            raise ResourceExhausted(f"{where}: {len(keep)} frames sampled at {fps:g} fps is over the limit of {limits.max_video_frames}")
        if check is not None:
            check(w, h, len(keep))
        try:
            frames = _frames(video, packets, set(keep.tolist()), (w, h), where)
            pcm = to_mono(_decoded(audio, sound), rate, limits.max_audio_seconds, where) if audio is not None else None
        except av.FFmpegError as e:
            raise InvalidArgument(f"{where}: cannot decode video: {ffmpeg_words(e)}") from None
    if len(frames) < len(keep):
        raise InvalidArgument(f"{where}: cannot decode video: {len(packets)} frames in the file, only {len(frames)} "
                              f"sampled ones decoded of {len(keep)}")
    return Clip(np.stack(frames), len(keep) / len(packets) * video_fps, pcm)


def _demux(container, video, audio, max_seconds: float, where: str) -> tuple[list, list]:
    """Every packet of the two streams, read without decoding; refused once past `max_seconds` (a header that
    understates the length), unreadable data refused as corrupt."""
    packets, sound = [], []
    try:
        for packet in container.demux(*[s for s in (video, audio) if s is not None]):
            if packet.size == 0:  # the demuxer's end-of-stream marker
                continue
            if packet.pts is not None and packet.time_base and packet.pts * packet.time_base > max_seconds + 1:
                raise ResourceExhausted(f"{where}: more than {max_seconds:.0f} s of video is over the limit")
            (packets if packet.stream is video else sound).append(packet)
    except av.FFmpegError as e:
        raise InvalidArgument(f"{where}: cannot decode video: {ffmpeg_words(e)}") from None
    return packets, sound


def _decoded(stream, packets):
    for packet in [*packets, None]:  # None flushes the frames the decoder holds back
        yield from stream.codec_context.decode(packet)


def _frames(video, packets, keep: set[int], size: tuple[int, int], where: str) -> list[np.ndarray]:
    """The frames at indices `keep` (in display order) as RGB, turned as a player shows them; every frame checked
    to be the header's size."""
    out, turn = [], None
    for i, frame in enumerate(_decoded(video, packets)):
        if (frame.width, frame.height) != size:
            raise InvalidArgument(f"{where}: frame {i} is {frame.width}x{frame.height}, the stream's header says {size[0]}x{size[1]}")
        if i == 0:  # one orientation for the stream: frames of one size
            turn = display_matrix(frame, video.metadata)
        if i in keep:
            out.append(np.ascontiguousarray(upright(frame.to_ndarray(format="rgb24"), turn)))
    return out

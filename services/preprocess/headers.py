"""What a media item's header says of its size, read without decoding any of it: the gateway counts a request's
tokens from these before the preprocess stage is called. Exact where the header counts pixels, samples or frames
(images, frame lists, raw PCM, WAV, MP4 and MOV video); from a stated duration otherwise. A reader answers None
where the header cannot say: the preprocess, which decodes, then has the last word on the item."""

import io
import warnings
from dataclasses import dataclass

import av
from PIL import Image

from omni.v1 import omni_pb2
from services.preprocess import audio_in, video_in
from services.preprocess.media import IMAGE_FORMATS, PCM_ENCODINGS, pcm_samples
from services.runtime.errors import InvalidArgument


@dataclass(frozen=True)
class Sound:
    seconds: float
    samples: int  # at the rate asked for


@dataclass(frozen=True)
class Frames:
    width: int
    height: int
    count: int  # frames the preprocess keeps: all of a list, a file's as Qwen's sampling picks them
    seconds: float = 0.0  # a file's, by its header
    sound: Sound | None = None  # a file's first audio stream


def resampled(samples: int, rate: int, to: int) -> int:
    """Samples FFmpeg's resampler makes of `samples` at `rate`, at `to`: it makes this many, or one more."""
    return samples * to // rate


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a PNG, JPEG or WebP, from its header."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - unreadable: the preprocess names why
        return None
    return img.size if img.format in IMAGE_FORMATS else None


def sound(audio: omni_pb2.Audio, rate: int) -> Sound | None:
    """An audio item's length once decoded to mono at `rate`: raw PCM's from its byte count, a file's from its header."""
    if audio.HasField("pcm"):
        p = audio.pcm
        try:
            n = pcm_samples(len(p.data), p.sample_rate, PCM_ENCODINGS.get(p.encoding, ""), p.channels or 1, "")
        except InvalidArgument:
            return None
        return Sound(n / p.sample_rate, resampled(n, p.sample_rate, rate))
    if not audio.file:
        return None
    try:
        with av.open(io.BytesIO(audio.file), mode="r", options={"format_whitelist": audio_in.DEMUXERS}) as container:
            return _stream_sound(container, container.streams.audio[0], rate) if container.streams.audio else None
    except Exception:  # noqa: BLE001
        return None


def frames(video: omni_pb2.Video, temporal: int, rate: int) -> Frames | None:
    """A video's frame size and the frames the preprocess keeps of it; a file's sound too, at `rate`."""
    if not video.file:
        size = image_size(video.frames[0].data) if video.frames else None
        return Frames(*size, len(video.frames)) if size else None
    try:
        with av.open(io.BytesIO(video.file), mode="r", options={"format_whitelist": video_in.DEMUXERS}) as container:
            if not container.streams.video:
                return None
            v = container.streams.video[0]
            seconds = _seconds(container, v)
            fps = float(v.average_rate or 0)
            total = v.frames or (round(seconds * fps) if seconds and fps else 0)
            if not total or not v.codec_context.width:
                return None
            keep = len(video_in.sample_indices(total, fps or total / seconds, video.fps or video_in.SAMPLE_FPS, temporal))
            audio = container.streams.audio[0] if container.streams.audio else None
            return Frames(v.codec_context.width, v.codec_context.height, keep, seconds or 0.0,
                          _stream_sound(container, audio, rate) if audio is not None else None)
    except Exception:  # noqa: BLE001
        return None


def _stream_sound(container, stream, rate: int) -> Sound | None:
    seconds = _seconds(container, stream)
    if seconds is None or not stream.rate:
        return None
    return Sound(seconds, resampled(round(seconds * stream.rate), stream.rate, rate))


def _seconds(container, stream) -> float | None:
    """A stream's duration: its own, else Matroska's per-stream tag, else the container's."""
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    if tag := stream.metadata.get("DURATION"):
        try:
            h, m, s = tag.split(":")
            return int(h) * 3600 + int(m) * 60 + float(s)
        except ValueError:
            pass
    return audio_in.header_seconds(container, stream)

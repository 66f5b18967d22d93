"""Audio files in, through PyAV (FFmpeg's demuxers, decoders and resampler): the containers the public API lists,
checked against the duration limit from their header before they are decoded, then decoded to mono float32 at
the model's rate, with the channels averaged as RawPcm's are."""

import io

import av
import numpy as np

from services.runtime.errors import InvalidArgument, ResourceExhausted

EXPECTED = "WAV, MP3, FLAC, Ogg, WebM or M4A"
# FFmpeg's demuxers for them; no other is ever opened (a playlist demuxer, say, would open the URLs it names).
DEMUXERS = "wav,mp3,flac,ogg,matroska,webm,mov,mp4,m4a"


def header_seconds(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def ffmpeg_words(e: av.FFmpegError) -> str:
    """FFmpeg's own words for an error, without the errno and file name PyAV wraps them in."""
    return e.strerror or str(e)


def too_long(seconds: float, limit: float, where: str) -> ResourceExhausted:
    return ResourceExhausted(f"{where}: {seconds:.1f} s of audio is over the limit of {limit:.0f} s")


def resample(pcm: np.ndarray, rate: int, to: int) -> np.ndarray:
    """Mono float32 samples at `rate` -> at `to`, through FFmpeg's resampler (what files are decoded with)."""
    if rate == to:
        return pcm
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, np.float32).reshape(1, -1), format="flt", layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=to)
    out = [f.to_ndarray().reshape(-1) for f in [*resampler.resample(frame), *resampler.resample(None)]]
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def to_mono(frames, rate: int, max_seconds: float, where: str) -> np.ndarray:
    """Decoded audio frames -> mono float32 samples at `rate`, refused once past `max_seconds` (a header that
    understates its length is caught here); FFmpeg's errors pass through."""
    # Planar float at the model's rate, every channel kept: averaged below, the same mono as RawPcm's.
    resampler = av.AudioResampler(format="fltp", rate=rate)
    limit = int(max_seconds * rate) + rate
    parts, samples = [], 0
    try:
        for frame in frames:
            for out in resampler.resample(frame):
                parts.append(out.to_ndarray().mean(axis=0, dtype=np.float32))
                samples += out.samples
            if samples > limit:
                raise ResourceExhausted(f"{where}: more than {max_seconds:.0f} s of audio is over the limit")
        parts += [out.to_ndarray().mean(axis=0, dtype=np.float32) for out in resampler.resample(None)]
    except av.FFmpegError:  # a decoder's error is also a ValueError: its caller words it
        raise
    except ValueError as e:  # the resampler refuses a stream whose layout or rate changes midway
        raise InvalidArgument(f"{where}: cannot decode audio: {e}") from None
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def decode_file(data: bytes, rate: int, max_seconds: float, where: str, check=None) -> np.ndarray:
    """An audio file's first audio stream -> mono float32 samples at `rate`; `check(seconds, where)` raises for a
    duration refused for other reasons (the context), from the header before decoding and after it."""
    if not data:
        raise InvalidArgument(f"{where}: empty audio")
    try:
        container = av.open(io.BytesIO(data), mode="r", options={"format_whitelist": DEMUXERS})
    except av.FFmpegError as e:
        raise InvalidArgument(f"{where}: cannot decode audio ({EXPECTED} expected): {ffmpeg_words(e)}") from None
    with container:
        if not container.streams.audio:
            raise InvalidArgument(f"{where}: the {container.format.long_name} file has no audio stream")
        stream = container.streams.audio[0]
        seconds = header_seconds(container, stream)
        if seconds is not None and seconds > max_seconds:
            raise too_long(seconds, max_seconds, where)
        if seconds is not None and check is not None:
            check(seconds, where)
        try:
            pcm = to_mono(container.decode(stream), rate, max_seconds, where)
        except av.FFmpegError as e:
            raise InvalidArgument(f"{where}: cannot decode audio: {ffmpeg_words(e)}") from None
    if len(pcm) == 0:
        raise InvalidArgument(f"{where}: audio has no samples")
    if len(pcm) > max_seconds * rate:
        raise too_long(len(pcm) / rate, max_seconds, where)
    if check is not None:
        check(len(pcm) / rate, where)
    return pcm

"""Decoders independent of the gateway's encoding path, for checking the audio it sends: libsndfile (soundfile: its
own libmpg123, libopus and libogg builds) for WAV, MP3 and Opus; FFmpeg's native FLAC and AAC decoders through
PyAV for the two libsndfile cannot read (a streamed FLAC's unknown length, and AAC at all). The gateway uses only
FFmpeg's encoders and muxers, never these decoders."""

import io

import av
import numpy as np
import soundfile as sf

# Samples per codec frame at 24 kHz: how far a decoded length may stray (MPEG-2 Layer III, AAC-LC, Opus's 20 ms, FLAC's
# block) beyond the codec's priming, which the lag below accounts for.
FRAME = {"mp3": 576, "aac": 1024, "opus": 480, "flac": 1152, "wav": 0, "pcm16": 0}


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """Encoded bytes -> (mono float32 samples in [-1, 1], sample rate)."""
    if fmt == "pcm16":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0, 24000
    if fmt in ("wav", "mp3", "opus"):
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
        return samples.mean(axis=1), rate
    with av.open(io.BytesIO(data), format={"flac": "flac", "aac": "aac"}[fmt]) as container:
        frames = [f.to_ndarray() for f in container.decode(audio=0)]
        rate = container.streams.audio[0].rate
    planar = np.concatenate([f.reshape(f.shape[0], -1) if f.ndim == 2 else f for f in frames], axis=1)
    if planar.dtype == np.int16:
        planar = planar.astype(np.float32) / 32768.0
    return planar.mean(axis=0).astype(np.float32), rate


def lag(decoded: np.ndarray, reference: np.ndarray, max_lag: int = 4096) -> int:
    """Samples by which `decoded` trails `reference` (a codec's priming), by cross-correlation."""
    n = min(len(reference), 24000)
    window = decoded[:n + min(max_lag, max(0, len(decoded) - n))]
    return int(np.argmax(np.correlate(window, reference[:n], "valid")))


def snr_db(decoded: np.ndarray, reference: np.ndarray) -> float:
    err = decoded - reference
    return 10 * np.log10(np.sum(reference ** 2) / max(np.sum(err ** 2), 1e-20))

"""The gateway's streaming encoders (services/gateway/audio_out.py): PCM16 in by chunks, container bytes out as they
are made, decoded back by decoders that are not the encoding path (tests/api/decoders.py)."""

import numpy as np
import pytest

from api.decoders import FRAME, decode, lag, snr_db
from omni.v1 import omni_pb2
from services.gateway.audio_out import AudioEncoder

RATE = 24000
FORMATS = {"mp3": omni_pb2.AUDIO_FORMAT_MP3, "opus": omni_pb2.AUDIO_FORMAT_OPUS, "aac": omni_pb2.AUDIO_FORMAT_AAC,
           "flac": omni_pb2.AUDIO_FORMAT_FLAC}
# Waveform SNR each codec keeps on a voiced, speech-like signal at its bit rate (measured: 26, 23, 28 dB).
MIN_SNR_DB = {"mp3": 18, "opus": 15, "aac": 20}
# LAME's last frame also carries the decoder's overlap: its padding runs a few samples past one frame.
TAIL = {"mp3": 64}


def voiced(seconds: float = 1.7) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    x = 0.3 * np.sin(2 * np.pi * (180 * t + 40 * t ** 2)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)) + 0.1 * np.sin(2 * np.pi * 900 * t)
    return (x * 32767).round().astype("<i2")


def encode(fmt: str, pcm16: np.ndarray, cuts: list[int]) -> list[bytes]:
    enc = AudioEncoder(FORMATS[fmt], RATE)
    bounds = [0, *cuts, len(pcm16)]
    return [enc.push(pcm16[a:b].tobytes()) for a, b in zip(bounds, bounds[1:])] + [enc.close()]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_stream_decodes_to_the_pcm(fmt):
    x = voiced()
    pieces = encode(fmt, x, [4000, 9000, 20000])  # a first chunk of 167 ms: two of the talker's 80 ms frames, and some
    assert all(pieces[:-1]), f"a push gave no bytes: {[len(p) for p in pieces]}"  # bytes leave as they are made
    decoded, rate = decode(b"".join(pieces), fmt)
    assert rate == RATE
    ref = x.astype(np.float32) / 32768.0
    k = lag(decoded, ref)
    extra = len(decoded) - k - len(ref)
    assert 0 <= extra < FRAME[fmt] + TAIL.get(fmt, 0), f"{len(decoded)} samples decoded, primed by {k}, for {len(ref)}"
    if fmt == "flac":
        assert k == 0 and np.array_equal(np.round(decoded * 32768).astype(np.int16), x)  # lossless
    else:
        assert snr_db(decoded[k:k + len(ref)], ref) > MIN_SNR_DB[fmt]
    if fmt == "opus":
        assert k == 0 and extra == 0  # Ogg's granule positions trim the pre-skip and the last packet exactly


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_prefix_of_the_stream_plays(fmt):
    """What a client holds mid-stream (the first pushes' bytes, no trailer) decodes to the speech so far."""
    x = voiced()
    pieces = encode(fmt, x, [6000, 12000, 30000])
    decoded, _ = decode(b"".join(pieces[:2]), "flac" if fmt == "flac" else fmt)
    assert 12000 - 2 * FRAME[fmt] - 1105 <= len(decoded) <= 12000 + 1105


def test_one_header_per_stream():
    """The stream's header (Ogg's OpusHead, FLAC's fLaC) is in the first bytes only, never once per chunk."""
    for fmt, magic in (("opus", b"OpusHead"), ("flac", b"fLaC")):
        pieces = encode(fmt, voiced(), [4000, 8000, 16000, 24000])
        assert pieces[0].count(magic) == 1 and b"".join(pieces[1:]).count(magic) == 0, fmt
    mp3 = b"".join(encode("mp3", voiced(), [4000, 8000]))
    assert not mp3.startswith(b"ID3") and b"Xing" not in mp3 and b"Info" not in mp3[:2000]

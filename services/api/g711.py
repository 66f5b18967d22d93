"""G.711 (ITU-T): mu-law and A-law bytes to and from PCM16, the 8 kHz telephone formats OpenAI's Realtime protocol
offers beside PCM16."""

import numpy as np

RATE = 8000
_BIAS, _CLIP = 0x84, 32635


def _mulaw_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + _BIAS) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, _BIAS - t, t - _BIAS).astype(np.int16)


def _alaw_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    seg, t = (a & 0x70) >> 4, (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, ((t + 0x108) << np.maximum(seg - 1, 0)))
    return np.where(a & 0x80, t, -t).astype(np.int16)


MULAW, ALAW = _mulaw_table(), _alaw_table()
# Encoding is a search in the decoded values of all 256 codes: the nearest code, as the standard's segments pick it
_ORDER = {"mulaw": np.argsort(MULAW, kind="stable"), "alaw": np.argsort(ALAW, kind="stable")}
_TABLES = {"mulaw": MULAW, "alaw": ALAW}


def decode(data: bytes, law: str) -> bytes:
    return _TABLES[law][np.frombuffer(data, np.uint8)].astype("<i2").tobytes()


def encode(pcm16: bytes, law: str) -> bytes:
    x = np.clip(np.frombuffer(pcm16, "<i2").astype(np.int32), -_CLIP, _CLIP)
    table, order = _TABLES[law], _ORDER[law]
    values = table[order].astype(np.int32)
    i = np.clip(np.searchsorted(values, x), 1, len(values) - 1)
    nearer = np.where(np.abs(values[i - 1] - x) <= np.abs(values[i] - x), i - 1, i)
    return order[nearer].astype(np.uint8).tobytes()

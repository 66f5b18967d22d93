"""The six benchmark workloads of BENCHMARK.md and their deterministic inputs.

A request is a conversation of parts, ("text", str) | ("image", PNG bytes) | ("audio", WAV bytes); the
load generator turns it into a GenerateRequest and the transformers baseline into model inputs, so both
engines see the same bytes. Request i uses media seed i % distinct and sampling seeds derived from i.
"""

import io
import wave
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from PIL import Image

from omni.v1 import omni_pb2

FRAMES_PER_SECOND = 12.5
# No 's': every merge of the byte-level tokenizer starts with "sy", "us" or "as", so N bytes are N tokens.
PROMPT_ALPHABET = np.array(list("abcdefghijklmnopqrtuvwxyz     "))


@dataclass(frozen=True)
class Workload:
    name: str
    media: str  # "text" | "image" | "audio"
    speech: bool
    max_tokens: int  # thinker tokens, exactly (EOS ignored)
    frames: int = 0  # codec frames, exactly (speech only)
    prompt_bytes: int = 0  # a generated ASCII prompt of this many bytes (= tokens), distinct per request
    prompt_text: str = ""  # a fixed short prompt


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("t2t", "text", False, 256, prompt_bytes=128),
    Workload("i2t", "image", False, 256, prompt_text="Describe this image."),
    Workload("s2t", "audio", False, 256, prompt_text="What is said in this clip?"),
    Workload("t2s", "text", True, 128, 250, prompt_bytes=32),
    Workload("i2s", "image", True, 128, 250, prompt_text="Describe this image."),
    Workload("s2s", "audio", True, 64, 63),
]}


@dataclass(frozen=True)
class MediaSpec:
    image_size: int = 512  # square, 256 visual tokens at full size
    clip_seconds: float = 7.0  # 16 kHz mono, 91 audio tokens at full size
    distinct: int = 0  # 0: every request its own input; else request i uses media seed i % distinct
    seed: int = 0


def select(names: str, max_tokens: int | None = None, frames: int | None = None,
           prompt_bytes: int | None = None) -> list[Workload]:
    """Workloads by comma-separated name, with every given length overriding theirs."""
    out = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        w = WORKLOADS[name]
        w = replace(w, max_tokens=max_tokens or w.max_tokens, frames=(frames or w.frames) if w.speech else 0,
                    prompt_bytes=(prompt_bytes or w.prompt_bytes) if w.prompt_bytes else 0)
        out.append(w)
    return out


def ascii_prompt(seed: int, n: int) -> str:
    rng = np.random.default_rng([seed, 1])
    chars = rng.choice(PROMPT_ALPHABET, n)
    chars[0] = chars[-1] = "x"  # no leading or trailing space
    return "".join(chars)


@lru_cache(maxsize=64)
def image_png(seed: int, size: int) -> bytes:
    """A smooth seeded picture (bicubic upsampling of a coarse random grid), PNG-encoded."""
    rng = np.random.default_rng([seed, 2])
    coarse = rng.integers(0, 256, (max(size // 32, 2), max(size // 32, 2), 3), dtype=np.uint8)
    img = Image.fromarray(coarse).resize((size, size), Image.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)  # fast to make; decoding cost is what the server sees
    return buf.getvalue()


@lru_cache(maxsize=64)
def clip_wav(seed: int, seconds: float, rate: int = 16000) -> bytes:
    """A seeded speech-like clip: a few gliding tones under a syllable-rate envelope, plus noise; PCM16 WAV."""
    rng = np.random.default_rng([seed, 3])
    t = np.arange(int(seconds * rate)) / rate
    signal = np.zeros_like(t)
    for _ in range(3):
        f0, glide = 120 + 300 * rng.random(), 40 * rng.standard_normal()
        signal += np.sin(2 * np.pi * (f0 * t + glide * t**2 / (2 * seconds)))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t + rng.random() * 6.28)
    mono = 0.2 * signal / 3 * envelope + 0.02 * rng.standard_normal(len(t))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(mono, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def conversation(w: Workload, index: int, media: MediaSpec) -> list[tuple[str, list[tuple[str, object]]]]:
    """[(role, parts)] of request `index` of workload `w`."""
    seed = media.seed * 100_003 + (index % media.distinct if media.distinct else index)
    parts: list[tuple[str, object]] = []
    if w.media == "image":
        parts.append(("image", image_png(seed, media.image_size)))
    elif w.media == "audio":
        parts.append(("audio", clip_wav(seed, media.clip_seconds)))
    if w.prompt_bytes:
        parts.append(("text", ascii_prompt(seed, w.prompt_bytes)))
    elif w.prompt_text:
        parts.append(("text", w.prompt_text))
    return [("user", parts)]


def sampling_seeds(index: int, base: int = 0) -> tuple[int, int]:
    """(thinker seed, talker seed) of request `index`; never 0, which means 'unseeded' in the API."""
    s = 2 * (base * 1_000_003 + index) + 1
    return s, s + 1


def grpc_request(w: Workload, index: int, media: MediaSpec, seed_base: int = 0) -> omni_pb2.GenerateRequest:
    """The public-API request: default (non-greedy) sampling, seeded, fixed lengths (EOS ignored)."""
    parts = []
    for kind, value in conversation(w, index, media)[0][1]:
        if kind == "text":
            parts.append(omni_pb2.Part(text=value))
        elif kind == "image":
            parts.append(omni_pb2.Part(image=omni_pb2.Image(data=value)))
        else:
            parts.append(omni_pb2.Part(audio=omni_pb2.Audio(file=value)))
    req = omni_pb2.GenerateRequest(
        messages=[omni_pb2.Message(role=omni_pb2.ROLE_USER, parts=parts)],
        output_modalities=[omni_pb2.MODALITY_TEXT] + ([omni_pb2.MODALITY_AUDIO] if w.speech else []),
        audio_format=omni_pb2.AUDIO_FORMAT_PCM16,
    )
    thinker_seed, talker_seed = sampling_seeds(index, seed_base)
    req.sampling.max_tokens, req.sampling.ignore_eos, req.sampling.seed = w.max_tokens, True, thinker_seed
    if w.speech:
        req.talker_sampling.max_tokens, req.talker_sampling.ignore_eos = w.frames, True
        req.talker_sampling.seed = talker_seed
    return req

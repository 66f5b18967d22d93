"""The benchmark workloads (BENCHMARK.md's six, and video with its sound in: v2t, v2s) and their deterministic inputs.

A request is a conversation of parts, ("text", str) | ("image", PNG bytes) | ("audio", WAV bytes) | ("video", MP4
bytes, heard too: use_audio_in_video); the load generator turns it into a GenerateRequest and the transformers
baseline into model inputs, so both engines see the same bytes. Request i uses media seed i % distinct and sampling
seeds derived from i.
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
    media: str  # "text" | "image" | "audio" | "video"
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
    Workload("v2t", "video", False, 256, prompt_text="What happens in this video?"),
    Workload("v2s", "video", True, 128, 250, prompt_text="What happens in this video?"),
]}


@dataclass(frozen=True)
class MediaSpec:
    image_size: int = 512  # square, 256 visual tokens at full size
    clip_seconds: float = 7.0  # 16 kHz mono, 91 audio tokens at full size
    distinct: int = 0  # 0: every request its own input; else request i uses media seed i % distinct
    seed: int = 0
    video_seconds: float = 10.0  # H.264 at 25 fps with an AAC soundtrack, sampled at Qwen's 2 fps: 20 frames
    video_size: tuple[int, int] = (640, 360)  # width, height


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


def voiced(seconds: float, rate: int = 24000, f0: float = 120.0, seed: int = 0) -> np.ndarray:
    """A sustained vowel, PCM16: a glottal pulse train through three formant resonators, at a syllable's pace;
    WebRTC's voice-activity detector takes it for speech, and silence (zeros) for none."""
    from scipy.signal import lfilter

    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    src = np.zeros(n)
    src[::int(rate / (f0 * (1 + 0.1 * rng.random())))] = 1.0
    x = src
    for f, bw in ((700, 130), (1220, 70), (2600, 160)):
        r, th = np.exp(-np.pi * bw / rate), 2 * np.pi * f / rate
        x = lfilter([1 - r], [1, -2 * r * np.cos(th), r * r], x)
    x = 0.5 * x / np.abs(x).max() * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * np.arange(n) / rate))
    return (x * 32767).astype("<i2")


def speechlike(seed: int, seconds: float, rate: int) -> np.ndarray:
    """A few gliding tones under a syllable-rate envelope, plus noise: mono float64 in [-1, 1]."""
    rng = np.random.default_rng([seed, 3])
    t = np.arange(int(seconds * rate)) / rate
    signal = np.zeros_like(t)
    for _ in range(3):
        f0, glide = 120 + 300 * rng.random(), 40 * rng.standard_normal()
        signal += np.sin(2 * np.pi * (f0 * t + glide * t**2 / (2 * seconds)))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t + rng.random() * 6.28)
    return np.clip(0.2 * signal / 3 * envelope + 0.02 * rng.standard_normal(len(t)), -1, 1)


@lru_cache(maxsize=64)
def clip_wav(seed: int, seconds: float, rate: int = 16000) -> bytes:
    """A seeded speech-like clip (`speechlike`), PCM16 WAV."""
    mono = speechlike(seed, seconds, rate)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((mono * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def video_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--video-size: WIDTHxHEIGHT expected, got {text!r}") from None
    if width < 32 or height < 32 or width % 2 or height % 2:  # yuv420p halves both sides
        raise SystemExit(f"--video-size: even sides of at least 32 expected, got {text!r}")
    return width, height


@lru_cache(maxsize=16)
def video_mp4(seed: int, seconds: float, size: tuple[int, int], fps: int = 25, rate: int = 48000) -> bytes:
    """A seeded clip made by PyAV: a smooth picture drifting across the frame (every sampled frame differs), H.264
    in MP4, with a speech-like AAC soundtrack. Cached: two encodings of one clip can differ in a few bytes."""
    import av

    width, height = size
    rng = np.random.default_rng([seed, 4])
    coarse = rng.integers(0, 256, (max(height // 32, 2), max(width // 32, 2), 3), dtype=np.uint8)
    picture = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC))
    sound = speechlike(seed, seconds, rate).astype(np.float32)[None]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        video = out.add_stream("libx264", rate=fps, options={"preset": "veryfast", "threads": "1"})
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = out.add_stream("aac", rate=rate, layout="mono")
        for i in range(round(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(np.roll(picture, 4 * i, axis=1), format="rgb24")
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
        step = audio.codec_context.frame_size or 1024
        for at in range(0, sound.shape[1], step):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(sound[:, at:at + step]), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = rate, at
            out.mux(audio.encode(frame))
        out.mux(audio.encode(None))
    return buf.getvalue()


def conversation(w: Workload, index: int, media: MediaSpec) -> list[tuple[str, list[tuple[str, object]]]]:
    """[(role, parts)] of request `index` of workload `w`."""
    seed = media.seed * 100_003 + (index % media.distinct if media.distinct else index)
    parts: list[tuple[str, object]] = []
    if w.media == "image":
        parts.append(("image", image_png(seed, media.image_size)))
    elif w.media == "audio":
        parts.append(("audio", clip_wav(seed, media.clip_seconds)))
    elif w.media == "video":
        parts.append(("video", video_mp4(seed, media.video_seconds, tuple(media.video_size))))
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
        elif kind == "video":
            parts.append(omni_pb2.Part(video=omni_pb2.Video(file=value, use_audio_in_video=True)))
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

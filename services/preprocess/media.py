"""Media bytes -> model-ready features: images and video frames to patches, audio to log-mel.

Everything is checked before it is decoded in full (format, pixel count, duration), and every failure names its
item. Patches leave as uint8, a quarter of float32's bytes and no float pass on the CPU; the encoder normalises
them on its device (`PixelNorm`) to the processor's floats."""

import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from omni.v1 import omni_pb2
from services.model.media_tokens import MediaSizes
from services.model.spec import audio_tokens
from services.preprocess.audio_in import decode_file, resample, too_long
from services.preprocess.video_in import SAMPLE_FPS, decode_video
from services.runtime.config import Limits
from services.runtime.errors import InvalidArgument, ResourceExhausted

IMAGE_FORMATS = {"PNG", "JPEG", "WEBP"}
PCM_ENCODINGS = {omni_pb2.PCM_ENCODING_S16LE: "s16le", omni_pb2.PCM_ENCODING_F32LE: "f32le"}
PCM_WIDTHS = {"s16le": 2, "f32le": 4}
SAMPLE_RATE = 16000


@dataclass
class Features:
    kind: str  # "image" | "audio" | "video"
    values: np.ndarray  # image/video: [patches, C*T*P*P] uint8 pixels; audio: [mel_bins, frames] float32
    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None
    feature_length: int = 0
    second_per_grid: float = 0.0
    soundtrack: np.ndarray | None = None  # a video file's sound, mono float32 at SAMPLE_RATE, where it was decoded
    with_audio: bool = False  # video: the next item is its soundtrack, interleaved with its frames in the prompt


def open_image(data: bytes, limits: Limits, where: str, fits=None) -> Image.Image:
    """An image checked from its header (format, pixels, and `fits(width, height)` if given), then decoded."""
    if not data:
        raise InvalidArgument(f"{where}: empty image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            if img.format not in IMAGE_FORMATS:
                raise InvalidArgument(f"{where}: image format {img.format} is not supported (PNG, JPEG or WebP)")
            w, h = img.size
            if w * h > limits.max_image_pixels:
                raise ResourceExhausted(f"{where}: image of {w}x{h} = {w * h} pixels is over the limit of {limits.max_image_pixels}")
            if fits is not None:
                fits(w, h)
            img.load()
    except (InvalidArgument, ResourceExhausted):
        raise
    except Image.UnidentifiedImageError:  # its message names the buffer by its Python repr
        raise InvalidArgument(f"{where}: cannot decode image: not a PNG, JPEG or WebP file") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ResourceExhausted(f"{where}: image too large: {e}") from None
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for corrupt data
        raise InvalidArgument(f"{where}: cannot decode image: {e}") from None
    if img.mode.startswith("I"):  # 16-bit grey: PIL's convert clips it to 8 bits (white), so scale it down instead
        img = Image.fromarray((np.asarray(img, dtype=np.float32) / 257).round().clip(0, 255).astype(np.uint8))
    return img.convert("RGB")


class Preprocessor:
    """Uses the checkpoint's own processor settings (preprocessor_config.json)."""

    def __init__(self, model_dir, limits: Limits, n_window: int = 50, context: int = 0):
        """`context`: the tokens a prompt may hold (0: no bound); audio past it is refused before it is decoded."""
        from transformers import WhisperFeatureExtractor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.images = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.audio = WhisperFeatureExtractor.from_pretrained(model_dir)
        self.model_dir, self.limits, self.n_window = model_dir, limits, n_window
        self.merge = self.images.merge_size
        self.sizes = MediaSizes.of(self.images, self.audio, n_window)
        self.context = context
        # The longest audio whose tokens fit the context (mel frames are 100 a second)
        self.context_seconds = context_seconds(context, n_window) if context else float("inf")

    def _resized(self, w: int, h: int, where: str, frames: int = 0) -> tuple[int, int]:
        """(height, width) the processor resizes a `w` x `h` image, or a frame of a video of `frames`, to."""
        try:
            return self.sizes.resized(w, h, frames)
        except ValueError as e:
            raise InvalidArgument(f"{where}: {e}") from None

    def _check_tokens(self, w: int, h: int, frames: int, where: str) -> None:
        """Refuses, from the header, an image or video whose tokens alone are past the context."""
        try:
            tokens = self.sizes.vision_tokens(self.sizes.grid(w, h, frames))
        except ValueError as e:
            raise InvalidArgument(f"{where}: {e}") from None
        if self.context and tokens > self.context:
            raise InvalidArgument(f"{where}: {w}x{h} makes {tokens} tokens, more than the context of {self.context} holds")

    def image(self, data: bytes, where: str = "image") -> Features:
        """The processor's patches, the same bytes, resized as it resizes but in uint8 (its float pass is slow)."""
        img = open_image(data, self.limits, where, lambda w, h: self._check_tokens(w, h, 0, where))
        w, h = img.size
        rh, rw = self._resized(w, h, where)
        pixels = np.asarray(img.resize((rw, rh), Image.BICUBIC) if (rw, rh) != (w, h) else img).transpose(2, 0, 1)[None]
        patches, grid = self._patches(pixels)
        return Features("image", patches, grid[0] * grid[1] * grid[2] // self.merge**2, grid)

    def _patches(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Frames [T, C, H, W] uint8 -> (patches [t * h * w, C * T * P * P] by merge window, (t, h, w))."""
        ip = self.images
        t_patch, p, m = ip.temporal_patch_size, ip.patch_size, self.merge
        if pad := -len(pixels) % t_patch:
            pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
        c, h, w = pixels.shape[1:]
        gt, gh, gw = len(pixels) // t_patch, h // p, w // p
        patches = pixels.reshape(gt, t_patch, c, gh // m, m, p, gw // m, m, p)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, c * t_patch * p * p)
        return np.ascontiguousarray(patches), (gt, gh, gw)

    def video(self, frames: list[bytes], fps: float, where: str = "video") -> Features:
        if not frames:
            raise InvalidArgument(f"{where}: a video needs at least one frame")
        if len(frames) > self.limits.max_video_frames:
            raise ResourceExhausted(f"{where}: {len(frames)} frames is over the limit of {self.limits.max_video_frames}")
        fps = self._fps(fps, 1.0, where)
        first = open_image(frames[0], self.limits, f"{where} frame 0", lambda w, h: self._check_tokens(w, h, len(frames), where))
        imgs = [first] + [open_image(f, self.limits, f"{where} frame {i}") for i, f in enumerate(frames[1:], 1)]
        if len({im.size for im in imgs}) != 1:
            raise InvalidArgument(f"{where}: all frames must have the same size")
        return self._video(imgs, fps, where)

    def video_file(self, data: bytes, fps: float, where: str = "video", sound: bool = True) -> Features:
        """A file's frames sampled at `fps` (default Qwen's 2.0) as Qwen's video processor samples them, then
        resized and patched as frames are; with `sound`, its soundtrack decoded as audio files are (unheard, Qwen's
        processor ignores a video's audio, so it is not even read)."""
        fps = self._fps(fps, SAMPLE_FPS, where)
        clip = decode_video(data, self.limits, where, fps, self.images.temporal_patch_size, SAMPLE_RATE,
                            lambda w, h, n: self._check_tokens(w, h, n, where), sound)
        out = self._video([Image.fromarray(f) for f in clip.frames], clip.fps, where)
        out.soundtrack = clip.audio
        return out

    def soundtrack(self, video: Features, where: str = "video") -> Features:
        """A video file's sound as an audio item, for use_audio_in_video (the video is marked as having it)."""
        if video.soundtrack is None:
            raise InvalidArgument(f"{where}: use_audio_in_video is set, but the video file has no audio stream")
        self._check_context(len(video.soundtrack) / SAMPLE_RATE, where)
        video.with_audio = True
        return self._audio(video.soundtrack, SAMPLE_RATE, f"{where} soundtrack")

    @staticmethod
    def _fps(fps: float, default: float, where: str) -> float:
        fps = fps or default
        if not 0 < fps <= 60:
            raise InvalidArgument(f"{where}: fps must be in (0, 60], got {fps}")
        return fps

    def _video(self, imgs: list[Image.Image], fps: float, where: str) -> Features:
        """Frames of one size at `fps` -> the processor's patches, each frame resized as it resizes them."""
        w, h = imgs[0].size
        rh, rw = self._resized(w, h, where, len(imgs))
        pixels = np.stack([np.asarray(im.resize((rw, rh), Image.BICUBIC)) for im in imgs]).transpose(0, 3, 1, 2)  # [T, C, H, W] uint8
        patches, (gt, gh, gw) = self._patches(pixels)
        return Features("video", patches, gt * gh * gw // self.merge**2, (gt, gh, gw),
                        second_per_grid=self.images.temporal_patch_size / fps)

    def audio_file(self, data: bytes, where: str = "audio") -> Features:
        pcm = decode_file(data, SAMPLE_RATE, self.limits.max_audio_seconds, where, self._check_context)
        return self._audio(pcm, SAMPLE_RATE, where)

    def audio_pcm(self, data: bytes, rate: int, encoding: str, channels: int, where: str = "audio") -> Features:
        channels = channels or 1
        n = pcm_samples(len(data), rate, encoding, channels, where)
        self._check_seconds(n / rate, where)
        pcm = np.frombuffer(data, "<i2" if encoding == "s16le" else "<f4").astype(np.float32)
        if encoding == "s16le":
            pcm /= 32768.0
        return self._audio(pcm.reshape(-1, channels).mean(axis=1), rate, where)

    def _check_seconds(self, seconds: float, where: str) -> None:
        if seconds > self.limits.max_audio_seconds:
            raise too_long(seconds, self.limits.max_audio_seconds, where)
        self._check_context(seconds, where)

    def _check_context(self, seconds: float, where: str) -> None:
        if seconds > self.context_seconds:
            raise InvalidArgument(f"{where}: {seconds:.1f} s of audio makes more tokens than the context of "
                                  f"{self.context} holds (at most {self.context_seconds:.1f} s)")

    def _audio(self, pcm: np.ndarray, rate: int, where: str) -> Features:
        if not np.isfinite(pcm).all():
            raise InvalidArgument(f"{where}: audio samples contain NaN or infinity")
        pcm = resample(pcm, rate, SAMPLE_RATE)  # FFmpeg's resampler, as for files: the same samples either way
        if len(pcm) <= self.audio.n_fft // 2:  # the spectrogram's first window reflects this many samples each side
            raise InvalidArgument(f"{where}: audio is too short ({len(pcm)} samples at {SAMPLE_RATE} Hz; "
                                  f"at least {self.audio.n_fft // 2 + 1})")
        out = self.audio([pcm], sampling_rate=SAMPLE_RATE, padding=True, truncation=False, return_attention_mask=True, return_tensors="np")
        frames = int(out["attention_mask"][0].sum())
        mel = np.ascontiguousarray(out["input_features"][0][:, :frames], dtype=np.float32)
        return Features("audio", mel, audio_tokens(frames, self.n_window), feature_length=frames)


def pcm_samples(nbytes: int, rate: int, encoding: str, channels: int, where: str) -> int:
    """Samples per channel in `nbytes` of raw PCM, its layout checked."""
    width = PCM_WIDTHS.get(encoding)
    if width is None:
        raise InvalidArgument(f"{where}: raw PCM needs an encoding (S16LE or F32LE)")
    if not 1000 <= rate <= 384000:
        raise InvalidArgument(f"{where}: sample rate {rate} is out of range")
    if not 1 <= channels <= 16:
        raise InvalidArgument(f"{where}: {channels} channels is out of range")
    if not nbytes or nbytes % (width * channels):
        raise InvalidArgument(f"{where}: {nbytes} bytes is not a whole number of {channels}-channel {encoding} samples")
    return nbytes // (width * channels)


def context_seconds(context: int, n_window: int) -> float:
    """The longest audio, in seconds, whose tokens (audio_tokens of its 100 mel frames a second) fit `context`."""
    lo, hi = 0, context * 100  # a mel frame makes at most one token
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if audio_tokens(mid, n_window) <= context else (lo, mid - 1)
    return lo / 100


class PixelNorm:
    """uint8 patches [N, C*T*P*P] normalised as the image processor does; float patches pass through."""

    def __init__(self, model_dir):
        cfg = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        self.rescale = float(cfg.get("rescale_factor", 1 / 255))
        self.mean = torch.tensor(cfg.get("image_mean", [0.5, 0.5, 0.5]), dtype=torch.float32)
        self.std = torch.tensor(cfg.get("image_std", [0.5, 0.5, 0.5]), dtype=torch.float32)
        self.on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if values.dtype != torch.uint8:
            return values.to(dtype)
        if values.device not in self.on:
            self.on[values.device] = self.mean.to(values.device)[None, :, None], self.std.to(values.device)[None, :, None]
        mean, std = self.on[values.device]
        x = values.float().view(values.shape[0], len(self.mean), -1)
        return ((x * self.rescale - mean) / std).view(values.shape).to(dtype)

"""Prompt tokens of a media item from its size alone, as Qwen3-Omni's processors count them: images and video frames
through the image processor's smart resize and patch grid, sound through the audio tower's length formula. The
preprocess lays out what it decodes with these, and the gateway counts a request from its media's headers with them
before anything is decoded."""

from dataclasses import dataclass

from services.model.spec import audio_tokens

# transformers' Qwen3-Omni video defaults (Qwen3OmniMoeProcessorKwargs)
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 32 * 32, 768 * 32 * 32
# transformers' Qwen2VLVideoProcessor max_video_tokens: a whole video's pixel budget is 90% of this many tokens'
VIDEO_MAX_TOKENS = 128000


@dataclass(frozen=True)
class MediaSizes:
    patch: int  # pixels on a patch's side
    merge: int  # patches on a token's side
    temporal: int  # frames one patch spans
    min_pixels: int  # an image's resized area, at least
    max_pixels: int  # and at most
    sample_rate: int  # the audio tower's input rate, Hz
    hop: int  # samples per mel frame
    n_window: int  # the audio tower's attention window, in mel frames

    @classmethod
    def of(cls, images, audio, n_window: int) -> "MediaSizes":
        """From the checkpoint's image processor and feature extractor, as transformers loaded them."""
        return cls(images.patch_size, images.merge_size, images.temporal_patch_size, images.size["shortest_edge"],
                   images.size["longest_edge"], audio.sampling_rate, audio.hop_length, n_window)

    @classmethod
    def load(cls, model_dir, n_window: int) -> "MediaSizes":
        from transformers import WhisperFeatureExtractor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return cls.of(Qwen2VLImageProcessorPil.from_pretrained(model_dir), WhisperFeatureExtractor.from_pretrained(model_dir),
                      n_window)

    def resized(self, width: int, height: int, frames: int = 0) -> tuple[int, int]:
        """(height, width) the processor resizes an image, or each frame of a video of `frames`, to; ValueError for a
        shape it refuses."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch * self.merge
        lo, hi = (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS) if frames else (self.min_pixels, self.max_pixels)
        if frames:  # each frame's even share of the video's budget, as Qwen2VLVideoProcessor.resize(cap_pixels_per_frame)
            total = int(VIDEO_MAX_TOKENS * factor * factor * 0.9)
            hi = max(min(hi, total * self.temporal // frames), int(lo * 1.05))
        return smart_resize(height, width, factor=factor, min_pixels=lo, max_pixels=hi)

    def grid(self, width: int, height: int, frames: int = 0) -> tuple[int, int, int]:
        """(t, h, w) in patches of an image (`frames` 0) or a video, its frames padded to whole temporal patches."""
        rh, rw = self.resized(width, height, frames)
        return max(1, -(-frames // self.temporal)), rh // self.patch, rw // self.patch

    def vision_tokens(self, grid: tuple[int, int, int]) -> int:
        return grid[0] * grid[1] * grid[2] // self.merge**2

    def mel_frames(self, samples: int) -> int:
        """Mel frames of `samples` at the tower's rate: the feature extractor drops its centred STFT's last column."""
        return samples // self.hop

    def sound_tokens(self, samples: int) -> int:
        return audio_tokens(self.mel_frames(samples), self.n_window)

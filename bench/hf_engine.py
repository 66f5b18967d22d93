"""The peer: transformers' own Qwen3-Omni `generate()`, in this process, on the same inputs and lengths.

A cell at concurrency B runs its requests in batches of B (left padding), one batch after another. Weights:
`load_format: random` draws exactly the mesh's random weights for the same seed (`init_full_model_`). Token times
come from a streamer on the thinker; speech comes out of `generate()` whole (time to first audio: the batch's).
"""

import gc
import io
import math
import time
import types

import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer

from bench.loadgen import LoopResult
from bench.records import RequestRecord
from bench.workloads import MediaSpec, Workload, conversation, sampling_seeds
from services.model.load import DTYPES
from services.model.spec import OmniSpec, audio_tokens
from services.runtime.config import MeshConfig


class StepTimes(BaseStreamer):
    """Records when each generated token reaches the host (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def sampling_kwargs(d: dict, prefix: str = "") -> dict:
    """generate() arguments for a request that sets no sampling: the model's defaults (OmniSpec.*_sampling), as the mesh's."""
    kw = {"do_sample": d["temperature"] > 0, "temperature": d["temperature"] or 1.0, "top_p": d["top_p"], "top_k": d["top_k"],
          "repetition_penalty": d["repetition_penalty"]}
    return {prefix + k: v for k, v in kw.items()}


def on_device(cls, config, device, dtype: torch.dtype):
    """transformers' `cls(config)` built on the device itself in `dtype` (not meta: that would leave buffers
    uninitialised), for the mesh's random weights to be drawn into."""
    from transformers import logging

    logging.set_verbosity_error()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config).eval()
    finally:
        torch.set_default_dtype(default)


def build_model(cfg: MeshConfig, device: str):
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

    from services.model.load import init_full_model_, load_config

    dtype = DTYPES[cfg.model.dtype]
    if cfg.model.load_format == "random":
        model = on_device(Qwen3OmniMoeForConditionalGeneration, load_config(cfg.model.dir), device, dtype)
        init_full_model_(model, 0)  # the native engines' random weights (seed 0)
    else:
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(cfg.model.dir, dtype=dtype).to(device)
    model.eval()
    if getattr(model, "has_talker", False):
        model.talker.config.audio_config = model.config.thinker_config.audio_config  # see tests/references.py
    return model


def processor_expand(tokenizer, merge: int):
    """transformers' own placeholder expansion (Qwen3OmniMoeProcessor.replace_multimodal_special_tokens) on a
    stand-in holding what it reads (the processor itself needs torchvision, MODEL.md): (texts, audio token counts,
    image grids, video grids, video seconds per grid, use_audio_in_video) -> the texts expanded, media in order."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        Qwen3OmniMoeProcessor, Qwen3OmniMoeProcessorKwargs,
    )

    videos_kwargs = Qwen3OmniMoeProcessorKwargs._defaults["videos_kwargs"]
    sizes = types.SimpleNamespace(merge_size=merge)
    fake = types.SimpleNamespace(image_processor=sizes, video_processor=sizes, **{
        k: getattr(tokenizer, k) for k in ("image_token", "audio_token", "video_token", "vision_bos_token",
                                           "vision_eos_token", "audio_bos_token", "audio_eos_token")})

    def expand(texts, audio_lengths, grids, vgrids, spg, use_audio_in_video):
        return Qwen3OmniMoeProcessor.replace_multimodal_special_tokens(
            fake, list(texts), iter(audio_lengths), iter(np.array(grids)), iter(np.array(vgrids)), iter(spg),
            use_audio_in_video, videos_kwargs["position_id_per_seconds"], videos_kwargs["seconds_per_chunk"])
    return expand


class HfEngine:
    def __init__(self, cfg: MeshConfig, device: str, media: MediaSpec, seed_base: int = 0):
        from transformers import AutoTokenizer, WhisperFeatureExtractor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from services.preprocess.media import PixelNorm, Preprocessor

        self.cfg, self.device, self.media, self.seed_base = cfg, torch.device(device), media, seed_base
        self.spec = OmniSpec.load(cfg.model.dir)
        self.model = build_model(cfg, device)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.dir, padding_side="left")
        self.images = Qwen2VLImageProcessorPil.from_pretrained(cfg.model.dir)
        self.audio = WhisperFeatureExtractor.from_pretrained(cfg.model.dir)
        # video files through our decoder (transformers' video processor needs torchvision), frames held to it in tests
        self.videos, self.pixels = Preprocessor(cfg.model.dir, cfg.limits), PixelNorm(cfg.model.dir)
        self.expand = processor_expand(self.tokenizer, self.images.merge_size)
        self.dtype = DTYPES[cfg.model.dtype]
        self.eos = self.spec.raw["im_end_token_id"]
        self.samples_per_frame = int(self.model.code2wav.total_upsample) if getattr(self.model, "has_talker", False) else 1920

    def settings(self) -> dict:
        return {"device": str(self.device), "dtype": self.cfg.model.dtype, "load_format": self.cfg.model.load_format,
                "seed": 0, "attn_implementation": self.model.config._attn_implementation,
                "thinker_sampling": self.spec.thinker_sampling, "talker_sampling": self.spec.talker_sampling,
                "voice": self.spec.default_voice}

    def inputs(self, w: Workload, indices: list[int]) -> dict:
        """Model inputs for a batch, prepared as Qwen3OmniMoeProcessor does (see tests/references.py)."""
        import soundfile as sf
        from PIL import Image

        texts, images, audios, videos = [], [], [], []
        for i in indices:
            messages = []
            for role, parts in conversation(w, i, self.media):
                messages.append({"role": role, "content": [{"type": "text", "text": v} if k == "text" else {"type": k} for k, v in parts]})
                for k, v in parts:
                    if k == "image":
                        images.append(Image.open(io.BytesIO(v)).convert("RGB"))
                    elif k == "audio":
                        audios.append(sf.read(io.BytesIO(v), dtype="float32")[0])
                    elif k == "video":  # heard too: its sound where the processor takes an audio length, in turn
                        videos.append(self.videos.video_file(v, 0.0))
                        audios.append(videos[-1].soundtrack)
            texts.append(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        kw = {"use_audio_in_video": bool(videos)}
        lengths, grids, vgrids, spg = [], [], [], []
        if images:
            out = self.images(images=images, return_tensors="pt")
            kw.update(pixel_values=out["pixel_values"].to(self.dtype), image_grid_thw=out["image_grid_thw"])
            grids = out["image_grid_thw"].tolist()
        if audios:
            out = self.audio(audios, sampling_rate=16000, padding=True, truncation=False, return_attention_mask=True, return_tensors="pt")
            kw.update(input_features=out["input_features"].to(self.dtype), feature_attention_mask=out["attention_mask"])
            lengths = [audio_tokens(int(n), self.spec.n_window) for n in out["attention_mask"].sum(-1)]
        if videos:
            vgrids, spg = [v.grid_thw for v in videos], [v.second_per_grid for v in videos]
            pixels = self.pixels(torch.from_numpy(np.concatenate([v.values for v in videos])), self.dtype)
            kw.update(pixel_values_videos=pixels, video_grid_thw=torch.tensor(vgrids), video_second_per_grid=torch.tensor(spg))
        texts = self.expand(texts, lengths, grids, vgrids, spg, kw["use_audio_in_video"])
        enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        kw.update(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}

    @torch.no_grad()
    def batch(self, w: Workload, indices: list[int]) -> list[RequestRecord]:
        """One generate() over the batch; every request's record carries the batch's times."""
        torch.manual_seed(sampling_seeds(indices[0], self.seed_base)[0])
        start = time.perf_counter()
        kw = self.inputs(w, indices)
        prompt_len = kw["input_ids"].shape[1]
        timer = StepTimes()
        if w.speech:
            seqs, wavs = self.model.generate(
                **kw, speaker=self.spec.default_voice, thinker_max_new_tokens=w.max_tokens, thinker_min_new_tokens=w.max_tokens,
                thinker_eos_token_id=self.eos, thinker_streamer=timer, **sampling_kwargs(self.spec.thinker_sampling, "thinker_"),
                # one more step than frames: the talker's last step only samples the code that would follow
                talker_max_new_tokens=w.frames + 1, talker_min_new_tokens=w.frames + 1,
                **sampling_kwargs(self.spec.talker_sampling, "talker_"),
            )
            samples = [int(x.shape[-1]) for x in (wavs if isinstance(wavs, list) else [wavs])]
        else:
            seqs = self.model.thinker.generate(
                **kw, max_new_tokens=w.max_tokens, min_new_tokens=w.max_tokens, eos_token_id=self.eos, streamer=timer,
                **sampling_kwargs(self.spec.thinker_sampling),
            )
            samples = [0] * len(indices)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        gaps = [b - a for a, b in zip(timer.times, timer.times[1:])]
        records = []
        for row, i in enumerate(indices):
            generated = seqs[row, prompt_len:].tolist()
            n = generated.index(self.eos) + 1 if self.eos in generated else len(generated)
            rec = RequestRecord(index=i, start=start, end=end, ttft=(timer.times[0] - start) if timer.times else None,
                                text_tokens=n, text_deltas=n, itl=list(gaps), usage_tokens=n,
                                prompt_tokens=int(kw["attention_mask"][row].sum()),
                                finished=True)
            if w.speech:
                rec.audio_samples, rec.audio_chunks, rec.ttfa = samples[row], 1, end - start
                rec.audio_frames = math.ceil(samples[row] / self.samples_per_frame)
            records.append(rec)
        return records

    def closed_batches(self, w: Workload, indices: list[int], batch: int, deadline: float | None = None) -> LoopResult:
        """`indices` in batches of `batch`, one after another; stops at the first failing batch or at `deadline`."""
        records: list[RequestRecord] = []
        duration, out_of_time = 0.0, False
        for at in range(0, len(indices), batch):
            if deadline is not None and time.perf_counter() > deadline:
                out_of_time = True
                break
            chunk = indices[at:at + batch]
            t0 = time.perf_counter()
            try:
                records += self.batch(w, chunk)
            except Exception as exc:  # noqa: BLE001 - out of memory or unsupported: recorded, the sweep goes on
                now = time.perf_counter()
                code = "RESOURCE_EXHAUSTED" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
                records += [RequestRecord(index=i, start=t0, end=now, error=code, detail=str(exc)[:500]) for i in indices[at:]]
                gc.collect()
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
                break
            duration += time.perf_counter() - t0
        return LoopResult(records, duration, client_cpu_s=0.0, messages=0, out_of_time=out_of_time)


"""The encoder engine: transformers' vision and audio towers, one call per tower a step for every item it holds
(varlen attention), the vision tower replayed from CUDA graphs on a GPU."""

import time
from dataclasses import dataclass, field

import torch

from services.encoder.attention import use_varlen_attention
from services.encoder.graphs import VisionGraphs
from services.encoder.plans import VisionPlans
from services.model.load import DTYPES, load_component
from services.model.spec import audio_tokens
from services.preprocess.media import PixelNorm
from services.runtime.config import ModelConfig
from services.runtime.errors import InvalidArgument


@dataclass
class Item:
    kind: str  # "image" | "video" | "audio"
    values: torch.Tensor  # image/video: [patches, C*T*P*P] uint8 or normalised; audio: [mel_bins, frames]
    grid_thw: tuple[int, int, int] | None = None


@dataclass
class Encoded:
    embeds: torch.Tensor  # [tokens, H]
    deepstack: list[torch.Tensor] = field(default_factory=list)
    ready: object = None  # a CUDA event after the step that made them


@dataclass
class EncodeJob:
    items: list[Item]
    done: bool = False
    seconds: float = 0.0
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0  # when a step took it


class Encoder:
    def __init__(self, model: ModelConfig, device: str = "cpu", graphs: bool = True):
        self.device, self.dtype = torch.device(device), DTYPES[model.dtype]
        args = model.dir, device, self.dtype, model.load_format
        self.vision = use_varlen_attention(load_component("vision", *args))
        self.audio = use_varlen_attention(load_component("audio", *args))
        self.plans = VisionPlans(self.vision, self.device)
        graphs = graphs and self.device.type == "cuda"  # off: eager, the reference the graphs are held to
        self.vision_graphs = VisionGraphs(self.vision, self.plans, self.device) if graphs else None
        vc = self.vision.config
        self.patch_width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        self.mel_bins = self.audio.config.num_mel_bins
        self.pixels = PixelNorm(model.dir)  # uint8 patches normalised here, on the towers' device

    def warm(self, image_side: int = 512, clip_seconds: float = 7.0) -> None:
        """An image and a clip through the towers, so first-use allocations (and that image's graph) come early."""
        vc = self.vision.config
        side = image_side // (vc.patch_size * vc.spatial_merge_size) * vc.spatial_merge_size  # patches a side
        image = Item("image", torch.zeros(side * side, self.patch_width, dtype=torch.uint8), (1, side, side))
        clip = Item("audio", torch.zeros(self.mel_bins, int(clip_seconds * 100)))
        if self.vision_graphs is not None:
            self.vision_graphs.capture(self.pixels(image.values.to(self.device), self.dtype), ((1, side, side),))
        self.step([EncodeJob([image, clip])])

    def add(self, job: EncodeJob) -> None:
        for i, item in enumerate(job.items):
            if item.kind == "audio":
                if item.values.dim() != 2 or item.values.shape[0] != self.mel_bins or not item.values.shape[1]:
                    raise InvalidArgument(f"item {i}: audio features must be [{self.mel_bins}, frames], got "
                                          f"{tuple(item.values.shape)}")
            elif item.kind in ("image", "video"):
                t, h, w = item.grid_thw or (0, 0, 0)
                if tuple(item.values.shape) != (t * h * w, self.patch_width) or t * h * w == 0:
                    raise InvalidArgument(f"item {i}: pixel patches {tuple(item.values.shape)} do not match grid {item.grid_thw}")
            else:
                raise InvalidArgument(f"item {i}: unknown media kind {item.kind!r}")

    def ready(self, job: EncodeJob) -> bool:
        return not job.done

    def free(self, job: EncodeJob) -> None:
        pass

    @torch.no_grad()
    def step(self, jobs: list[EncodeJob]) -> list[tuple[EncodeJob, list[Encoded]]]:
        started = time.perf_counter()
        for job in jobs:
            job.started = started
        out = self._encode(jobs)
        if self.device.type == "cuda":  # the transport copies after this, not after later steps
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            for _, encoded in out:
                for e in encoded:
                    e.ready = ready
        return out

    def _encode(self, jobs: list[EncodeJob]) -> list[tuple[EncodeJob, list[Encoded]]]:
        t0 = time.perf_counter()
        items = [item for job in jobs for item in job.items]
        encoded: dict[int, Encoded] = {}
        visual = [i for i in items if i.kind != "audio"]
        if visual:
            pooled, deepstack = self._vision(torch.cat([self.pixels(i.values.to(self.device), self.dtype) for i in visual]),
                                             tuple(tuple(i.grid_thw) for i in visual))
            sizes = [i.grid_thw[0] * i.grid_thw[1] * i.grid_thw[2] // self.vision.spatial_merge_size**2 for i in visual]
            taps = [d.split(sizes) for d in deepstack]
            for n, (item, e) in enumerate(zip(visual, pooled.split(sizes))):
                encoded[id(item)] = Encoded(e, [t[n] for t in taps])
        audio = [i for i in items if i.kind == "audio"]
        if audio:
            mels = [self._mel(i) for i in audio]
            out = self.audio(torch.cat(mels, dim=1), feature_lens=torch.tensor([m.shape[1] for m in mels], device=self.device))
            sizes = [audio_tokens(m.shape[1], self.audio.config.n_window) for m in mels]
            for item, e in zip(audio, out.last_hidden_state.split(sizes)):
                encoded[id(item)] = Encoded(e)
        elapsed = time.perf_counter() - t0
        for job in jobs:
            job.done, job.seconds = True, elapsed
        return [(job, [encoded[id(i)] for i in job.items]) for job in jobs]

    def _vision(self, pixels: torch.Tensor, grids) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Merged embeddings and DeepStack features of normalised patches, from a graph or eagerly."""
        if self.vision_graphs is not None:
            return self.vision_graphs(pixels, grids)
        out = self.vision(pixels, **self.plans(grids))
        return out.pooler_output, list(out.deepstack_features)

    def _mel(self, item: Item) -> torch.Tensor:
        return item.values.to(self.device, self.dtype)

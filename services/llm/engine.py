"""The native engines' core: a model on a paged KV cache, continuous batching with chunked prefill, one step loop.

A step launches its forward and sampling without reading back, then finishes the step before it. With `overlap`,
a step whose rows' inputs the device already holds is launched before the previous one is read, so the host's
work hides behind the device's. A model's engine supplies `launch`, `finish` and `runs_ahead`."""

import time

import torch
from torch import nn

from services.llm.attention import TorchAttention, pick_backend
from services.llm.context import step_context
from services.llm.fp8 import fp8_layout, quantize_experts_
from services.llm.fusion import fuse
from services.llm.host import Laps
from services.llm.kv_cache import BlockAllocator, KVCache
from services.llm.layers import fuse_projections_
from services.llm.moe import capturable, resolve
from services.llm.pieces import StepPieces
from services.llm.scheduler import Scheduler, Work
from services.model.load import DTYPES, default_dtype, load_config, load_weights_
from services.runtime.config import EngineConfig, ModelConfig
from services.runtime.errors import RequestFailed


def load_model(factory, component: str, model: ModelConfig, device: torch.device, fp8: str = "off") -> nn.Module:
    """`factory(checkpoint config)` on `device` with `component`'s weights, experts in `fp8`, projections fused."""
    dtype = DTYPES[model.dtype]
    if device.type == "cuda":
        fuse()
    with torch.device(device), default_dtype(dtype):
        module = factory(load_config(model.dir))
    load_weights_(module, component, model.dir, dtype, model.load_format)
    if fp8 != "off":
        quantize_experts_(module, *fp8_layout(fp8, model.dir, model.load_format, component), activations=fp8 == "channel")
    module.to(device).eval().requires_grad_(False)  # no compiled variants for autograd
    fuse_projections_(module)
    return module


class Engine:
    KV_SHARE = 0.8  # of the memory free after the weights
    KV_HEADROOM = 8 << 30  # left at least for activations, graphs, sampling
    KV_CPU_BYTES = 1 << 30

    def __init__(self, decoder: nn.Module, text_config, cfg: EngineConfig, device: torch.device, dtype: torch.dtype,
                 fp8: str = "off"):
        """`decoder`: a layers.Decoder; `text_config`: its sizes."""
        self.cfg, self.device, self.dtype, self.text_config = cfg, torch.device(device), dtype, text_config
        self.moe = resolve(cfg.moe, self.device)
        self.attention_backend = pick_backend(cfg.attention, self.device, dtype)
        flashinfer = self.attention_backend == "flashinfer"
        self.workspace = None
        if flashinfer:
            from services.llm.flashinfer_attention import WORKSPACE_BYTES, FlashInferAttention
            self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        tc, bs = text_config, cfg.block_size
        blocks = cfg.kv_blocks or self._fitting_blocks()
        # One block more than the allocator hands out: padding rows of captured steps write there
        self.cache = KVCache.allocate(tc.num_hidden_layers, blocks + 1, bs, tc.num_key_value_heads, tc.head_dim, dtype,
                                      self.device)
        self.scratch_block = blocks
        self.scheduler = Scheduler(BlockAllocator(blocks), bs, cfg.max_batched_tokens, cfg.max_seqs)
        scale = tc.head_dim ** -0.5
        self.attention = (FlashInferAttention(self.cache, scale, tc.num_attention_heads, self.workspace) if flashinfer
                          else TorchAttention(self.cache, scale))
        cuda = self.device.type == "cuda"
        self.graphable = cuda and flashinfer and capturable(self.moe, fp8)
        self.pieces = None
        if cfg.step_graphs and (self.graphable or not cuda):
            self.pieces = StepPieces(decoder, self.cache, min(cfg.step_graphs, cfg.max_batched_tokens), self.moe,
                                     blocks * bs, graphs=cuda)
        self.overlap = cfg.overlap
        self.pending = None  # launched, outputs not read yet
        self.overlapped = 0
        self.laps = Laps()

    @property
    def decode_batch(self) -> int:
        """The largest decode step captured as a graph (0: none)."""
        return min(self.cfg.cuda_graph_max_batch, self.cfg.max_seqs) if self.graphable else 0

    def _fitting_blocks(self) -> int:
        tc, bs = self.text_config, self.cfg.block_size
        per_block = KVCache.bytes_per_block(tc.num_hidden_layers, bs, tc.num_key_value_heads, tc.head_dim, self.dtype)
        if self.device.type != "cuda":
            return max(64, self.KV_CPU_BYTES // per_block)
        free, _ = torch.cuda.mem_get_info(self.device)
        # An allocator that runs out frees its cache and retries every step, which costs more than the blocks
        blocks = int(min(free * self.KV_SHARE, free - self.KV_HEADROOM)) // per_block - 1
        if blocks < 1:
            raise MemoryError(f"{free / 2**30:.1f} GiB free on {self.device} after the weights: no room for a KV cache "
                              "(size it by hand with kv_blocks)")
        return blocks

    @property
    def capacity(self) -> int:
        """Positions the KV cache holds."""
        return self.scheduler.allocator.num_blocks * self.scheduler.block_size

    def summary(self, graphs: str = "") -> str:
        pieces = f", steps of up to {self.pieces.max_tokens} tokens in pieces" if self.pieces is not None else ""
        return (f"native (attention {self.attention_backend}, experts {self.moe}{graphs}{pieces}, "
                f"{self.scheduler.allocator.num_blocks} KV blocks of {self.scheduler.block_size})")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attention, run, after_layer=None) -> torch.Tensor:
        """The decoder's output: in pieces where they hold the step, else `run()` in the step's context."""
        if self.pieces is not None and x.shape[0] <= self.pieces.max_tokens:
            return self.pieces.forward(x, positions, attention, after_layer)
        with step_context(attention, self.moe):
            return run()

    # -- the step loop -------------------------------------------------------------------------------

    def schedule(self, reqs: list) -> list[Work]:
        return self.scheduler.schedule()

    def runs_ahead(self, work: list[Work]) -> bool:
        """Whether every row of `work` can be launched before the pending step's outputs are read."""
        raise NotImplementedError

    def launch(self, work: list[Work], ahead: bool):
        """Queues forward and sampling, reading nothing back -> what `finish` takes; `ahead` of the pending step."""
        raise NotImplementedError

    def finish(self, launched) -> list:
        """A launched step's outputs, its one wait on the device: [(request, output)]."""
        raise NotImplementedError

    def _launch_isolated(self, work: list[Work], ahead: bool, out: list):
        """`launch`, less each request whose own inputs failed: it ends with its error among `out`, the rest go on."""
        while work:
            try:
                return self.launch(work, ahead)
            except RequestFailed as failed:
                failed.req.done = True  # the worker frees it after posting the error
                out.append((failed.req, failed.error))
                work = [w for w in work if w.seq.owner is not failed.req]
        return None

    def account(self, work: list[Work], started: float, seconds: float) -> None:
        """A step of `work` began at `started` and took the host `seconds`."""

    @torch.no_grad()
    def step(self, reqs: list) -> list:
        """One step over what the scheduler picks -> the outputs of the step it finishes (with overlap, the last);
        a request whose own inputs failed gets its error as its output, and is done."""
        t0 = time.perf_counter()
        self.laps.start()
        work = self.schedule(reqs)
        self.laps.lap("schedule")
        out = []
        ahead = bool(work) and self.overlap and self.runs_ahead(work)
        if self.pending is not None and not ahead:  # its outputs are this step's inputs
            out += self.finish(self.pending)
            self.pending = None
            work = [w for w in work if not w.seq.owner.done]
        launched = self._launch_isolated(work, ahead, out) if work else None
        if self.pending is not None:
            out += self.finish(self.pending)
            self.overlapped += 1
        self.pending = None
        if launched is not None and ahead:
            self.pending = launched
        elif launched is not None:
            out += self.finish(launched)
        self.laps.lap("rest")
        self.account(work, t0, time.perf_counter() - t0)
        return out

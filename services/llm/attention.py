"""Attention over the paged KV cache for a step that mixes prefill chunks and decode tokens.

`TorchAttention` is the reference (any device): each sequence attends over its pages with SDPA, as transformers
does. Every backend hands out `kv_slots`, so a layer's projection writes k and v into the cache itself."""

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.llm.kv_cache import KVCache


@dataclass
class SeqSlice:
    """One sequence's part of a step: rows [start, start + n) of the step attend to its first `cached + n` keys."""
    block_table: list[int]
    cached: int
    n: int


class AttentionBackend(Protocol):
    """What a decoder layer calls, through the step context, on the backend planned for its step."""

    def kv_slots(self, layer: int):
        """Where the step's new k and v go in `layer`'s cache (the projection writes them), or None."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                written: bool = False) -> torch.Tensor:
        """q [N, heads, D], k and v [N, kv_heads, D] (already in the cache if `written`) -> [N, heads, D]."""


class DecodeSlices:
    """A decode step's SeqSlices, made as they are read: a steady plan reads only rows with a full last page."""
    __slots__ = ("work",)

    def __init__(self, work: list):
        self.work = work

    def __len__(self) -> int:
        return len(self.work)

    def __getitem__(self, i: int) -> SeqSlice:
        w = self.work[i]
        return SeqSlice(w.seq.blocks, w.start, 1)

    def __iter__(self):
        return (SeqSlice(w.seq.blocks, w.start, 1) for w in self.work)


class TorchAttention:
    def __init__(self, cache: KVCache, scale: float):
        self.cache, self.scale = cache, scale
        self.slices: list[SeqSlice] = []
        self.slot_mapping = None

    def plan(self, slices: list[SeqSlice]) -> "TorchAttention":
        bs = self.cache.block_size
        slots = []
        for s in slices:
            pos = torch.arange(s.cached, s.cached + s.n)
            table = torch.tensor(s.block_table, dtype=torch.long)
            slots.append(table[pos // bs] * bs + pos % bs)
        self.slices = slices
        self.slot_mapping = torch.cat(slots).to(self.cache.k.device)
        return self

    def kv_slots(self, layer: int):
        """(k cache [slots, Hkv, D], v cache, the step's slots)."""
        return kv_slots(self.cache, layer, self.slot_mapping)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, written: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """q [N, H, D], k and v [N, Hkv, D] -> [N, H, D]; `written`: k and v are in the cache already."""
        if not written:
            write_kv(self.kv_slots(layer), k, v)
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        out, row = torch.empty_like(q) if out is None else out, 0
        groups = q.shape[1] // kc.shape[2]  # cache [blocks, block size, kv heads, D]
        for s in self.slices:
            total = s.cached + s.n
            blocks = torch.tensor(s.block_table[: -(-total // self.cache.block_size)], device=kc.device)
            keys = kc[blocks].reshape(-1, *kc.shape[2:])[:total].repeat_interleave(groups, dim=1)  # [T, H, D]
            values = vc[blocks].reshape(-1, *vc.shape[2:])[:total].repeat_interleave(groups, dim=1)
            qs = q[row:row + s.n].transpose(0, 1)[None]  # [1, H, n, D]
            if s.n == 1 or s.cached == 0:  # the masks transformers would use
                mask, causal = None, s.n > 1
            else:
                mask, causal = torch.ones(s.n, total, dtype=torch.bool, device=q.device).tril(s.cached), False
            o = F.scaled_dot_product_attention(qs, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                               attn_mask=mask, is_causal=causal, scale=self.scale)
            out[row:row + s.n] = o[0].transpose(0, 1)
            row += s.n
        return out


def kv_slots(cache: KVCache, layer: int, slots: torch.Tensor):
    kc, vc = cache.k[layer], cache.v[layer]
    return kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:]), slots


def write_kv(target, k: torch.Tensor, v: torch.Tensor) -> None:
    """k and v [N, Hkv, D] into `target`, a backend's kv_slots."""
    flat_k, flat_v, slots = target
    flat_k[slots] = k
    flat_v[slots] = v


class DenseAttention:
    """B sequences at one position over a dense cache [layers, B, T, kv_heads, D]: fixed shapes, so a graph holds it."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, scale: float):
        self.k, self.v, self.scale = k, v, scale
        self.b = self.cached = self.n = 0
        self.slots: dict[tuple[int, int, int], torch.Tensor] = {}  # (b, cached, n) -> the step's cache rows

    def at(self, b: int, cached: int, n: int) -> "DenseAttention":
        """The next forward: `n` new rows for each of the first `b` sequences after `cached` positions."""
        self.b, self.cached, self.n = b, cached, n
        return self

    def kv_slots(self, layer: int):
        """The layer's cache as [B * T, Hkv, D] and the step's rows, made once a shape (before a graph records it)."""
        kc, vc = self.k[layer], self.v[layer]
        key = (self.b, self.cached, self.n)
        if key not in self.slots:
            rows = torch.arange(self.b, device=kc.device)[:, None] * kc.shape[1] + self.cached
            self.slots[key] = (rows + torch.arange(self.n, device=kc.device)).reshape(-1)
        return kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:]), self.slots[key]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, written: bool = False) -> torch.Tensor:
        """q [b*n, H, D], k and v [b*n, Hkv, D], sequence-major -> [b*n, H, D]."""
        b, c, n = self.b, self.cached, self.n
        kc, vc = self.k[layer], self.v[layer]
        if not written:
            kc[:b, c:c + n] = k.view(b, n, *k.shape[1:])
            vc[:b, c:c + n] = v.view(b, n, *v.shape[1:])
        keys, values = kc[:b, :c + n].transpose(1, 2), vc[:b, :c + n].transpose(1, 2)  # [b, Hkv, T, D]
        qs = q.view(b, n, *q.shape[1:]).transpose(1, 2)  # [b, H, n, D]
        mask = None if n == 1 or c == 0 else torch.ones(n, c + n, dtype=torch.bool, device=q.device).tril(c)
        if mask is not None:  # flash attention, the one backend that shares kv heads itself, takes no mask
            groups = q.shape[1] // k.shape[1]
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, is_causal=n > 1 and c == 0,
                                             scale=self.scale, enable_gqa=mask is None)
        return out.transpose(1, 2).reshape(b * n, *q.shape[1:])


def pick_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """auto: flashinfer on a GPU in 16-bit precision when installed, else PyTorch's reference."""
    if name != "auto":
        if name == "flashinfer" and (device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16)):
            raise ValueError(f"attention: flashinfer needs a GPU and bfloat16 or float16, not {device.type} / {dtype}")
        return name
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "torch"
    return "flashinfer" if importlib.util.find_spec("flashinfer") else "torch"

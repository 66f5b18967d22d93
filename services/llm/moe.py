"""Routed experts of a MoE layer, three ways: the loop over experts that transformers runs (the reference,
in its order of summation), a grouped GEMM over tokens sorted by expert (one launch per projection), and
for the few tokens of a decode step Triton kernels that stream each touched expert once (triton_moe.py;
with `triton_sorted`, longer steps too, their rows grouped by expert first)."""

import torch
import torch.nn.functional as F

from services.llm import triton_moe


TRITON = ("triton", "triton_sorted")  # backends whose decode-sized steps run the Triton kernels


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                backend: str = "loop", residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H]; ids, weights [N, k]; gate_up [E, 2I, H]; down [E, H, I] -> [N, H], plus `residual` if given."""
    if backend in TRITON and x.is_cuda and x.shape[0] <= triton_moe.MAX_TOKENS:
        return triton_moe.experts(x, ids, weights, gate_up, down, residual=residual)
    if backend == "triton_sorted" and x.is_cuda and x.shape[0] <= triton_moe.SORTED_MAX_TOKENS:
        return triton_moe.experts_sorted(x, ids, weights, gate_up, down, residual=residual)
    if backend in ("grouped", *TRITON):  # compiled (when fused) in bf16, the dtype torch compiles grouped GEMMs for
        out = (OPS["grouped"] if x.dtype == torch.bfloat16 else grouped)(x, ids, weights, gate_up, down)
    else:
        out = loop(x, ids, weights, gate_up, down)
    return out if residual is None else out + residual


def capturable(backend: str, fp8_experts: str = "off") -> bool:
    """Whether a decode step's experts run without asking the device for sizes, so a CUDA graph can hold them."""
    return backend in TRITON or (backend == "grouped" and fp8_experts != "block")


def loop(x, ids, weights, gate_up, down):
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, gate_up.shape[0]).permute(2, 1, 0)  # [E, k, N]
    for e in (mask.sum((-1, -2)) > 0).nonzero()[:, 0].tolist():
        slot, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def by_expert(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) rows of `ids` [T, k] grouped by expert, in row order within each (what a stable
    argsort gives), and each group's end offset [E] (int32), by counting instead of sorting: a radix sort is
    the largest kernel of a decode step's routing, and bincount asks the device for its size, which no
    graph can capture."""
    flat = ids.reshape(-1)
    onehot = F.one_hot(flat, experts).to(torch.int32)  # [R, E]
    counts = onehot.sum(0)
    rank = (onehot.cumsum(0) * onehot).sum(1) - 1  # place of each row within its expert's group
    pos = (counts.cumsum(0) - counts)[flat] + rank
    order = torch.empty_like(flat).scatter_(0, pos.long(), torch.arange(flat.numel(), device=flat.device))
    return order, counts.cumsum(0).to(torch.int32)


@torch.compiler.disable
def take(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows[index] by ATen's gather kernel, kept out of compiled code. Inductor's own gather of the routed rows
    (2,048 tokens, top 8 of 128: 16,384 rows of 2,048) took 290 us in fp8, the quantisation folded into it, where
    this takes 12; a layer at that size 0.85 ms instead of 1.11 in fp8, 0.99 instead of 1.21 in bf16
    (bench/gather.py)."""
    return rows.index_select(0, index)


def grouped(x, ids, weights, gate_up, down):
    n, k = ids.shape
    order, offs = by_expert(ids, gate_up.shape[0])  # rows grouped by expert: T*k rows, E groups
    h = torch._grouped_mm(take(x, order // k), gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)  # [T*k, H]
    return combine(y, order, weights, x.dtype)


def combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Routed rows `y` [T*k, H], in expert order (`order` from by_expert), back to their tokens [T, H]: each
    token's k rows weighted and summed in float32, then rounded once, as the Triton kernels combine. An
    index_add_ would add them with atomics, in an order (and with bf16 roundings between) that changes from run
    to run: the same prompt would not give the same tokens twice."""
    n, k = weights.shape
    rows = torch.empty_like(y).index_copy_(0, order, y)  # row t*k + slot: each index once, so deterministic
    return (rows.view(n, k, -1).float() * weights.float()[..., None]).sum(1).to(dtype)


OPS = {"grouped": grouped}  # services.llm.layers.fuse() compiles it

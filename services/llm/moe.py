"""Routed experts of a MoE layer, by the step context's `moe_backend`: transformers' loop (the reference), a
grouped GEMM over rows grouped by expert, or Triton kernels for decode steps (triton_moe.py)."""

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from services.llm import triton_moe, triton_route
from services.llm.context import get_context
from services.llm.fusion import fusable


class ExpertsBackend(Protocol):
    """x [N, H]; ids, weights [N, k]; gate_up [E, 2I, H]; down [E, H, I] -> [N, H], plus `residual` if given."""

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor: ...


def resolve(backend: str, device: torch.device) -> str:
    """`auto`: the Triton kernels on a GPU, the reference loop elsewhere."""
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" else "loop"
    if backend not in EXPERTS:
        raise ValueError(f"moe must be auto or one of {tuple(EXPERTS)}, not {backend!r}")
    return backend


def decode_kernels(backend: str, x: torch.Tensor) -> bool:
    return backend == "triton" and x.is_cuda and x.shape[0] <= triton_moe.MAX_TOKENS


def _plus(out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return out if residual is None else out + residual


def _loop(x, ids, weights, gate_up, down, residual=None):
    return _plus(loop(x, ids, weights, gate_up, down), residual)


def _grouped(x, ids, weights, gate_up, down, residual=None):
    # torch compiles grouped GEMMs for bf16 only
    return _plus((grouped if x.dtype == torch.bfloat16 else grouped.plain)(x, ids, weights, gate_up, down), residual)


def _triton(x, ids, weights, gate_up, down, residual=None):
    """Decode-sized steps on the Triton kernels, longer ones (and the CPU) on the grouped GEMM."""
    if decode_kernels("triton", x):
        return triton_moe.experts(x, ids, weights, gate_up, down, residual=residual)
    return _grouped(x, ids, weights, gate_up, down, residual)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                backend: str = "loop", residual: torch.Tensor | None = None) -> torch.Tensor:
    return EXPERTS[backend](x, ids, weights, gate_up, down, residual)


def capturable(backend: str, fp8: str = "off") -> bool:
    """Whether the experts ask the device for no sizes, so a CUDA graph can hold them."""
    return backend == "triton" or (backend == "grouped" and fp8 != "block")


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
    """-> (rows of `ids` [T, k] by expert as a stable argsort, group ends [E]) by counting: no sort, no device size."""
    flat = ids.reshape(-1)
    onehot = F.one_hot(flat, experts).to(torch.int32)  # [R, E]
    counts = onehot.sum(0)
    rank = (onehot.cumsum(0) * onehot).sum(1) - 1  # within its expert's group
    pos = (counts.cumsum(0) - counts)[flat] + rank
    order = torch.empty_like(flat).scatter_(0, pos.long(), torch.arange(flat.numel(), device=flat.device))
    return order, counts.cumsum(0).to(torch.int32)


@torch.compiler.disable
def take(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows[index] by ATen, outside compiled code: inductor's gather of the routed rows is many times slower."""
    return rows.index_select(0, index)


@fusable
def grouped(x, ids, weights, gate_up, down):
    n, k = ids.shape
    order, offs = by_expert(ids, gate_up.shape[0])
    h = torch._grouped_mm(take(x, order // k), gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)  # [T*k, H]
    return combine(y, order, weights, x.dtype)


def combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Routed rows `y` [T*k, H] back to tokens [T, H] in float32, deterministically: index_add_'s atomics are not."""
    n, k = weights.shape
    rows = torch.empty_like(y).index_copy_(0, order, y)  # each index once: deterministic
    return (rows.view(n, k, -1).float() * weights.float()[..., None]).sum(1).to(dtype)


@fusable
def route(x, gate_w, top_k: int, norm_topk: bool):
    """Top-k experts per token and their weights, in x's dtype."""
    logits = F.linear(x, gate_w)  # [N, E]
    probs = logits.softmax(-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights.to(logits.dtype)


# The bf16 experts by the step context's `moe_backend` (fp8.py's experts dispatch their own way)
EXPERTS: dict[str, ExpertsBackend] = {"loop": _loop, "grouped": _grouped, "triton": _triton}


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))


class Experts(nn.Module):
    """All experts of a layer: gate_up_proj [E, 2I, H], down_proj [E, H, I] (transformers' fused layout)."""

    def __init__(self, hidden: int, experts: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return moe_experts(x, ids, weights, self.gate_up_proj, self.down_proj, get_context().moe_backend, residual)


class SparseMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size)
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def routed(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' output, plus `residual` (the kernels add it for free)."""
        if decode_kernels(get_context().moe_backend, x):
            ids, weights = triton_route.route(x, self.gate.weight, self.top_k, self.norm_topk)  # two kernels, not five
        else:
            ids, weights = route(x, self.gate.weight, self.top_k, self.norm_topk)
        return self.experts(x, ids, weights, residual)  # a module, so fp8.py can swap it

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.routed(x, residual)

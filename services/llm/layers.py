"""Building blocks shared by the thinker and the talker: RMSNorm, M-RoPE, QK-norm attention over a paged
KV cache, and the sparse MoE block. Parameter names follow the checkpoints, so weights load by name."""

import torch
import torch.nn.functional as F
from torch import nn

from services.llm.context import get_context
from services.llm.moe import moe_experts


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MRope(nn.Module):
    """cos/sin [N, D] for positions [3, N] (time, height, width), the three sections interleaved."""

    def __init__(self, head_dim: int, theta: float, sections: list[int]):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim), persistent=False)
        self.sections = sections

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [3, N, D/2]
        mixed = freqs[0].clone()
        for row in (1, 2):  # frequency j takes height if j % 3 == 1, width if j % 3 == 2, within each section
            idx = slice(row, self.sections[row] * 3, 3)
            mixed[..., idx] = freqs[row, ..., idx]
        emb = torch.cat([mixed, mixed], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos, sin [N, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, layer: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.layer = heads, kv_heads, head_dim, layer
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]  # N = tokens of the step, all sequences
        q = rotate(self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim)), cos, sin)
        k = rotate(self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        out = get_context().attention.forward(self.layer, q, k, v)  # [N, heads, D]
        return self.o_proj(out.reshape(n, -1))


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

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return moe_experts(x, ids, weights, self.gate_up_proj, self.down_proj, get_context().moe_backend)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Top-k of E experts per token, the chosen weights renormalised when `norm_topk`; optionally a shared
    expert every token goes through, scaled by a sigmoid gate (the talker's)."""

    def __init__(self, hidden: int, experts: int, intermediate: int, top_k: int, norm_topk: bool, shared: int = 0):
        super().__init__()
        self.gate = Router(hidden, experts)
        self.experts = Experts(hidden, experts, intermediate)
        self.top_k, self.norm_topk = top_k, norm_topk
        if shared:
            self.shared_expert = MLP(hidden, shared)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate.weight)  # [N, E]
        probs = logits.softmax(-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        out = self.experts(x, ids, weights.to(logits.dtype))  # a module: quantisation swaps it (services/llm/fp8.py)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP: a sparse MoE when the config has experts, a dense MLP otherwise."""

    def __init__(self, cfg, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   cfg.rms_norm_eps, layer)
        if getattr(cfg, "num_experts", 0):
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                                 cfg.norm_topk_prob, getattr(cfg, "shared_expert_intermediate_size", 0))
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

"""Building blocks shared by the thinker and the talker: RMSNorm, M-RoPE, QK-norm attention over a paged KV
cache, dense MLPs, the decoder stack. Parameter names follow the checkpoints, so weights load by name."""

import torch
import torch.nn.functional as F
from torch import nn

from services.llm import triton_linear
from services.llm.context import get_context
from services.llm.fusion import fusable
from services.llm.moe import SparseMoE


@fusable
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class MRope(nn.Module):
    """cos/sin [N, D] for positions [3, N] (time, height, width), the three sections interleaved."""

    def __init__(self, head_dim: int, theta: float, sections: list[int]):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim), persistent=False)
        self.sections = sections

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [3, N, D/2]
        mixed = freqs[0].clone()
        for row in (1, 2):  # within each section, frequency j takes height if j % 3 == 1, width if 2
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
    """QK-norm attention's weights; DecoderLayer runs it in parts (projections, the backend's kernel, output)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, layer: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.layer = heads, kv_heads, head_dim, layer
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.register_buffer("qkv_weight", None, persistent=False)  # set by fuse_projections_

    def qkv(self, x: torch.Tensor, norm: "RMSNorm", cos: torch.Tensor, sin: torch.Tensor, kv=None):
        if self.qkv_weight is None:
            raise RuntimeError("attention projections not fused: call fuse_projections_(model) once its weights are loaded")
        return pre_attention(x, norm.weight, self.qkv_weight, self.q_norm.weight, self.k_norm.weight, cos, sin,
                             norm.eps, self.heads, self.kv_heads, self.head_dim, kv)

    def fuse_projections_(self) -> None:
        """q, k and v in one tensor for one GEMM; the parameters become views of it, keeping checkpoint names."""
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()
        self.qkv_weight = w
        q, k = self.q_proj.weight.shape[0], self.k_proj.weight.shape[0]
        for proj, part in ((self.q_proj, w[:q]), (self.k_proj, w[q:q + k]), (self.v_proj, w[q + k:])):
            proj.weight = nn.Parameter(part, requires_grad=False)


def fuse_projections_(model: nn.Module) -> int:
    """Fuses every attention's q/k/v and every dense MLP's gate/up -> the attentions fused."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for m in layers:
        m.fuse_projections_()
    for m in model.modules():
        if isinstance(m, MLP):
            m.fuse_projections_()
    return len(layers)


@fusable
def pre_attention(x, norm_w, qkv_w, qn_w, kn_w, cos, sin, eps: float, heads: int, kv_heads: int, head_dim: int, kv=None):
    """[N, H] -> q [N, heads, D], k, v [N, kv_heads, D] (into `kv` if given); q and k normed and rotated as one."""
    n = x.shape[0]  # tokens of the step, all sequences
    qkv = triton_linear.linear(rms_norm.plain(x, norm_w, eps), qkv_w)
    qk, v = qkv.split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
    qk_w = torch.cat([qn_w.expand(heads, head_dim), kn_w.expand(kv_heads, head_dim)])
    q, k = rotate(rms_norm.plain(qk.reshape(n, heads + kv_heads, head_dim), qk_w, eps), cos, sin).split([heads, kv_heads], dim=1)
    v = v.reshape(n, kv_heads, head_dim)
    if kv is not None:
        flat_k, flat_v, slots = kv
        flat_k[slots] = k
        flat_v[slots] = v
    return q, k, v


@fusable
def post_attention(x, attn, o_w, norm_w, eps: float):
    """Output projection, residual, the MLP's norm -> (residual, normed); triton_linear's partials summed here."""
    x = x + triton_linear.linear(attn, o_w)
    return x, rms_norm.plain(x, norm_w, eps)


@fusable
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # set by fuse_projections_

    def fuse_projections_(self) -> None:
        """gate and up in one tensor for one GEMM; the parameters become views of it, keeping checkpoint names."""
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight]).detach()
        self.gate_up_weight = w
        i = self.gate_proj.weight.shape[0]
        self.gate_proj.weight = nn.Parameter(w[:i], requires_grad=False)
        self.up_proj.weight = nn.Parameter(w[i:], requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Three kernels, not six; the residual is added into in place, as out of place cuBLAS would copy it first."""
        if self.gate_up_weight is None or x.dim() != 2:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
            return out if residual is None else residual + out
        act = silu_mul(F.linear(x, self.gate_up_weight))
        if residual is None:
            return F.linear(act, self.down_proj.weight)
        return residual.addmm_(act, self.down_proj.weight.t())


class DecoderLayer(nn.Module):
    """Pre-norm attention, then `moe` where the config has experts, else a dense MLP."""

    def __init__(self, cfg, layer: int, moe: type = SparseMoE):
        super().__init__()
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   cfg.rms_norm_eps, layer)
        self.mlp = moe(cfg) if getattr(cfg, "num_experts", 0) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn, backend = self.self_attn, get_context().attention
        kv = backend.kv_slots(attn.layer)  # for the projection to write k and v itself
        q, k, v = self.before_attention(x, cos, sin, kv)
        out = backend.forward(attn.layer, q, k, v, written=kv is not None)  # [N, heads, D]
        return self.after_attention(x, out)

    # The two parts around attention: pieces.py records each as a graph
    def before_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None):
        return self.self_attn.qkv(x, self.input_layernorm, cos, sin, kv)

    def after_attention(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x [N, H] and the attention's [N, heads, D] -> the layer's output [N, H]."""
        norm = self.post_attention_layernorm
        x, h = post_attention(x, out.reshape(x.shape[0], -1), self.self_attn.o_proj.weight, norm.weight, norm.eps)
        return self.mlp(h, residual=x)


class Decoder(nn.Module):
    """Layers + final norm over given input embeddings [N, D] at positions [3, N]."""

    def __init__(self, cfg, rope_sections: list[int], moe: type = SparseMoE):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, moe) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = MRope(cfg.head_dim, cfg.rope_parameters["rope_theta"], rope_sections)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`rope`: (cos, sin) [N, D] made already, in place of `positions` (the code predictor's never change)."""
        cos, sin = rope if rope is not None else self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

"""Building blocks shared by the thinker and the talker: RMSNorm, M-RoPE, QK-norm attention over a paged
KV cache, and the sparse MoE block. Parameter names follow the checkpoints, so weights load by name."""

import torch
import torch.nn.functional as F
from torch import nn

from services.llm import triton_linear, triton_moe, triton_route
from services.llm.context import get_context
from services.llm.moe import TRITON, moe_experts


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OPS["rms_norm"](x, self.weight, self.eps)  # compiled (fuse()): one kernel, not seven


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


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
        self.register_buffer("qkv_weight", None, persistent=False)  # q, k, v in one, once loaded (fuse_projections_)

    def qkv(self, x: torch.Tensor, norm: "RMSNorm", cos: torch.Tensor, sin: torch.Tensor, kv=None):
        if self.qkv_weight is None:
            raise RuntimeError("attention projections not fused: call fuse_projections_(model) once its weights are loaded")
        return OPS["pre_attention"](x, norm.weight, self.qkv_weight, self.q_norm.weight, self.k_norm.weight, cos, sin,
                                    norm.eps, self.heads, self.kv_heads, self.head_dim, kv, get_context().triton_linear)

    def fuse_projections_(self) -> None:
        """q, k and v weights in one tensor, for one GEMM instead of three; the three parameters stay, as
        views of it, so the weights keep their checkpoint names."""
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()
        self.qkv_weight = w
        q, k = self.q_proj.weight.shape[0], self.k_proj.weight.shape[0]
        for proj, part in ((self.q_proj, w[:q]), (self.k_proj, w[q:q + k]), (self.v_proj, w[q + k:])):
            proj.weight = nn.Parameter(part, requires_grad=False)


def fuse_projections_(model: nn.Module) -> int:
    """Every attention of `model` with its q/k/v projections fused (Attention.fuse_projections_), and every dense
    MLP with its gate and up projections (MLP.fuse_projections_). Returns the attentions fused."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for m in layers:
        m.fuse_projections_()
    for m in model.modules():
        if isinstance(m, MLP):
            m.fuse_projections_()
    return len(layers)


def pre_attention(x, norm_w, qkv_w, qn_w, kn_w, cos, sin, eps: float, heads: int, kv_heads: int, head_dim: int, kv=None,
                  few_rows: bool = False):
    """Input norm, the fused q/k/v projection, QK-norm and rotary embedding:
    [N, H] -> q [N, heads, D], k and v [N, kv_heads, D]; with `kv` (an attention backend's kv_slots), k and v
    also written into the cache. q's and k's heads are normed and rotated as one tensor, each head by its own
    weight: compiled, the norm and the rotation take 2.0 and 1.4 us a layer at 32 requests
    (bench/results/profile-1xh200-b32-decode-fp8a8-acc04a2.txt), where q's and k's kernels took 5.9 and 5.5
    (profile-1xh200-b32-decode-f29cb53.txt). q and k are views of it: attention takes q's strides. `few_rows`: the
    projection through triton_linear where the step is short enough."""
    n = x.shape[0]  # N = tokens of the step, all sequences
    qkv = triton_linear.linear(rms_norm(x, norm_w, eps), qkv_w, few_rows)
    qk, v = qkv.split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
    qk_w = torch.cat([qn_w.expand(heads, head_dim), kn_w.expand(kv_heads, head_dim)])
    q, k = rotate(rms_norm(qk.reshape(n, heads + kv_heads, head_dim), qk_w, eps), cos, sin).split([heads, kv_heads], dim=1)
    v = v.reshape(n, kv_heads, head_dim)
    if kv is not None:
        flat_k, flat_v, slots = kv
        flat_k[slots] = k
        flat_v[slots] = v
    return q, k, v


def post_attention(x, attn, o_w, norm_w, eps: float, few_rows: bool = False):
    """Output projection and residual, then the MLP's input norm: returns (residual stream, normed). `few_rows`: the
    projection through triton_linear where the step is short enough (its partial sums added up in this kernel)."""
    x = x + triton_linear.linear(attn, o_w, few_rows)
    return x, rms_norm(x, norm_w, eps)


def route(x, gate_w, top_k: int, norm_topk: bool):
    """Top-k experts per token and their weights (renormalised when `norm_topk`), in x's dtype."""
    logits = F.linear(x, gate_w)  # [N, E]
    probs = logits.softmax(-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights.to(logits.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """A dense MLP's activation from its fused gate and up projections [N, 2I] -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def shared_combine(routed: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """A MoE block with a shared expert: the routed experts' output plus the shared expert's, scaled by its gate."""
    return routed + torch.sigmoid(gate) * shared


# The layers' pure tensor functions; `fuse()` swaps in compiled versions (elementwise chains fused by inductor).
OPS = {"pre_attention": pre_attention, "post_attention": post_attention, "route": route, "silu_mul": silu_mul,
       "shared_combine": shared_combine, "rms_norm": rms_norm}


def fuse(enabled: bool = True) -> None:
    """Compiles the layers' tensor functions (and the grouped experts, and the code predictor's sampling) once
    per process, shapes dynamic: a step's tens of small kernels per layer become a few. Attention kernels and
    the KV writes stay outside."""
    import torch._inductor.config as inductor

    from services.llm import fp8, moe, sampling

    inductor.emulate_precision_casts = True  # round where eager rounds (to bf16 between ops): the same numbers
    # One variant per model (thinker, talker, predictor: their sizes are constants) and per special row count
    # (1): past dynamo's default of 8 variants a function runs eagerly, as the talker's steps of 64 rows did.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for name, fn in (("pre_attention", pre_attention), ("post_attention", post_attention), ("route", route),
                     ("silu_mul", silu_mul), ("shared_combine", shared_combine), ("rms_norm", rms_norm)):
        OPS[name] = torch.compile(fn, dynamic=True) if enabled else fn
    moe.OPS["grouped"] = torch.compile(moe.grouped, dynamic=True) if enabled else moe.grouped
    fp8.OPS["grouped"] = torch.compile(fp8.grouped, dynamic=True) if enabled else fp8.grouped
    # The code predictor's draw, 15 times a frame inside its graph: the seed hash and the race fused.
    sampling.OPS["sample_tensors"] = torch.compile(sampling.sample_tensors, dynamic=True) if enabled else sampling.sample_tensors


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


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # gate and up in one, once loaded

    def fuse_projections_(self) -> None:
        """gate and up weights in one tensor, for one GEMM instead of two; the two parameters stay, as views of
        it, so the weights keep their checkpoint names."""
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight]).detach()
        self.gate_up_weight = w
        i = self.gate_proj.weight.shape[0]
        self.gate_proj.weight = nn.Parameter(w[:i], requires_grad=False)
        self.up_proj.weight = nn.Parameter(w[i:], requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Fused: three kernels (gate-and-up GEMM, the activation, the down GEMM with the residual added in its
        epilogue) where the plain form takes six; the code predictor runs 75 of these a frame. The residual is
        added into in place (the layer's residual stream, read by nothing after): out of place, cuBLAS first
        copies it into the output, a kernel more each time (bench/results/profile-1xh200-talker-b32-eecd411.txt)."""
        if self.gate_up_weight is None or x.dim() != 2:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
            return out if residual is None else residual + out
        act = OPS["silu_mul"](F.linear(x, self.gate_up_weight))
        if residual is None:
            return F.linear(act, self.down_proj.weight)
        return residual.addmm_(act, self.down_proj.weight.t())


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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output, plus `residual` when given (the routed experts' kernels add it for free)."""
        if get_context().moe_backend in TRITON and x.is_cuda and x.shape[0] <= triton_moe.MAX_TOKENS:
            ids, weights = triton_route.route(x, self.gate.weight, self.top_k, self.norm_topk)  # two kernels, not five
        else:
            ids, weights = OPS["route"](x, self.gate.weight, self.top_k, self.norm_topk)
        if not hasattr(self, "shared_expert"):
            return self.experts(x, ids, weights, residual)  # a module: quantisation swaps it (services/llm/fp8.py)
        routed = self.experts(x, ids, weights, residual)  # the residual added by the experts' own kernels
        return OPS["shared_combine"](routed, self.shared_expert_gate(x), self.shared_expert(x))


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
        attn, backend = self.self_attn, get_context().attention
        kv = backend.kv_slots(attn.layer)  # where the keys and values go, for the projection to write them
        q, k, v = self.before_attention(x, cos, sin, kv)
        out = backend.forward(attn.layer, q, k, v, written=kv is not None)  # [N, heads, D]
        return self.after_attention(x, out)

    # The layer in two parts around its attention kernel (services/llm/pieces.py records each as a graph).
    def before_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None):
        """Input norm, q/k/v, QK-norm, rotation: q [N, heads, D], k and v [N, kv_heads, D] (with `kv`, a
        backend's kv_slots, k and v written into the cache too)."""
        return self.self_attn.qkv(x, self.input_layernorm, cos, sin, kv)

    def after_attention(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, norm and the MLP: the layer's output [N, H] from its input and the
        attention's [N, heads, D]."""
        norm = self.post_attention_layernorm
        x, h = OPS["post_attention"](x, out.reshape(x.shape[0], -1), self.self_attn.o_proj.weight, norm.weight, norm.eps,
                                     get_context().triton_linear)
        return self.mlp(h, residual=x)

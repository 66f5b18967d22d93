"""fp8 (e4m3) experts, applied from outside the model by swapping each layer's experts module.

Weights are quantised once at load, per output channel or per 128 x 128 tile; activations per token at run time.
The reference dequantises and runs the float experts' loop: what faster fp8 kernels are held to."""

import torch
import torch.nn.functional as F
from torch import nn

from services.llm import triton_moe
from services.llm.context import get_context
from services.llm.fusion import fusable
from services.llm.moe import Experts, by_expert, combine, decode_kernels, moe_experts, take

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_BLOCK = 128  # as DeepSeek-style fp8 checkpoints tile


def quantize(w: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (fp8 [..., N, K], float32 scales [..., N] per row, or [..., N/b, K/b] per b x b tile)."""
    w = w.float()
    if block is None:
        scale = w.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
        return (w / scale[..., None]).to(FP8), scale
    *lead, n, k = w.shape
    if n % block or k % block:
        raise ValueError(f"a {n} x {k} matrix does not split into {block} x {block} tiles")
    tiles = w.reshape(*lead, n // block, block, k // block, block)
    scale = tiles.abs().amax((-3, -1)).clamp_min(1e-12) / FP8_MAX  # [..., N/b, K/b]
    q = (tiles / scale[..., :, None, :, None]).to(FP8).reshape(w.shape)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if block is None:
        return q.to(dtype) * scale[..., None].to(dtype)
    *lead, n, k = q.shape
    tiles = q.to(dtype).reshape(*lead, n // block, block, k // block, block) * scale[..., :, None, :, None].to(dtype)
    return tiles.reshape(q.shape)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (fp8 [T, K], scales [T, 1])."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (x.float() / scale).to(FP8), scale


def quantize_groups(x: torch.Tensor, group: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (fp8 [T, K], scales [T, K / group]), as the Triton experts quantise fp8 activations."""
    t, k = x.shape
    g = x.float().reshape(t, k // group, group)
    scale = g.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    return (g / scale[..., None]).to(FP8).reshape(t, k), scale


def fake_quant_groups(x: torch.Tensor, group: int = FP8_BLOCK) -> torch.Tensor:
    q, s = quantize_groups(x, group)
    return (q.float().reshape(*s.shape, group) * s[..., None]).reshape(x.shape)


def fake_quant_tokens(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize_tokens(x)
    return q.float() * s


class Fp8Experts(nn.Module):
    """The experts of one layer in fp8, with their scales; same call as `Experts`."""

    def __init__(self, experts: Experts, block: int | None, stored: tuple[torch.Tensor, ...] | None = None,
                 activations: bool = False):
        """Quantises `experts` or takes `stored`; `activations`: the Triton kernels multiply e4m3 inputs too."""
        super().__init__()
        self.block, self.activations = block, activations
        for i, name in enumerate(("gate_up_proj", "down_proj")):
            weight = getattr(experts, name)
            if stored is None:
                q, scale = quantize(weight.detach(), block)
            else:
                q, scale = (t.to(weight.device) for t in stored[2 * i:2 * i + 2])
                if q.shape != weight.shape:
                    raise ValueError(f"stored fp8 {name} {tuple(q.shape)} for experts of {tuple(weight.shape)}")
            self.register_buffer(name, q)
            self.register_buffer(f"{name}_scale", scale)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        backend = get_context().moe_backend
        if decode_kernels(backend, x):
            return triton_moe.experts(x, ids, weights, self.gate_up_proj, self.down_proj, self.gate_up_proj_scale,
                                      self.down_proj_scale, self.block, residual, self.activations)
        if x.is_cuda and backend in ("grouped", "triton") and self.block is None:
            out = self.grouped(x, ids, weights)
        elif x.is_cuda and backend == "triton":  # a long step: dequantised once, bf16 grouped GEMM
            gate_up = dequantize(self.gate_up_proj, self.gate_up_proj_scale, self.block, x.dtype)
            down = dequantize(self.down_proj, self.down_proj_scale, self.block, x.dtype)
            out = moe_experts(x, ids, weights, gate_up, down, "grouped")
        else:
            out = self.reference(x, ids, weights)
        return out if residual is None else out + residual

    def grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return grouped(x, ids, weights, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj, self.down_proj_scale)

    def reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Per-token fp8 activations and dequantised weights through the experts loop (any device)."""
        out = torch.zeros_like(x)
        xq = fake_quant_tokens(x)
        mask = F.one_hot(ids, self.gate_up_proj.shape[0]).permute(2, 1, 0)  # [E, k, N]
        for e in (mask.sum((-1, -2)) > 0).nonzero()[:, 0].tolist():
            slot, tok = torch.where(mask[e])
            gate_up = dequantize(self.gate_up_proj[e], self.gate_up_proj_scale[e], self.block)
            down = dequantize(self.down_proj[e], self.down_proj_scale[e], self.block)
            gate, up = F.linear(xq[tok], gate_up).chunk(2, dim=-1)
            y = F.linear(fake_quant_tokens(F.silu(gate) * up), down) * weights[tok, slot, None].float()
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def fp8_layout(fp8: str, model_dir, load_format: str, component: str) -> tuple[int | None, dict | None]:
    """(block, stored experts) for quantize_experts_; `block` from a block-fp8 checkpoint takes its own values."""
    if fp8 != "block":
        return None, None
    from services.model.load import checkpoint_fp8_block, read_fp8_experts

    tile = checkpoint_fp8_block(model_dir) if load_format != "random" else None
    if tile is None:
        return FP8_BLOCK, None
    return tile, read_fp8_experts(model_dir, component, tile)


def quantize_experts_(model: nn.Module, block: int | None = None, stored: dict | None = None,
                      activations: bool = False) -> int:
    """Swaps every experts module for its fp8 version in place -> how many; `stored` (by module name) as they are."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if isinstance(getattr(module, "experts", None), Experts):
            key = f"{name}.experts" if name else "experts"
            module.experts = Fp8Experts(module.experts, block, (stored or {}).get(key), activations)
            swapped += 1
    return swapped


@fusable
def grouped(x, ids, weights, gate_up, gate_up_scale, down, down_scale) -> torch.Tensor:
    """fp8 x fp8 grouped GEMMs, per-token and per-channel scales; no host sync, so graphs can hold it."""
    n, k = ids.shape
    order, offs = by_expert(ids, gate_up.shape[0])
    tok = order // k
    xq, xs = quantize_tokens(x)  # each token once, then its rows gathered as bytes
    h = torch._scaled_grouped_mm(take(xq, tok), gate_up.transpose(1, 2), take(xs[:, 0], tok), gate_up_scale, offs=offs,
                                 out_dtype=torch.bfloat16)
    gate, up = h.chunk(2, dim=-1)
    aq, a_scale = quantize_tokens(F.silu(gate) * up)
    y = torch._scaled_grouped_mm(aq, down.transpose(1, 2), a_scale[:, 0], down_scale, offs=offs, out_dtype=torch.bfloat16)
    return combine(y, order, weights, x.dtype)

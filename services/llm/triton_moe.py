"""Routed experts as Triton kernels, for the few tokens of a decode step.

A decode step's cost is reading the touched experts' weights, so each program takes one expert, up to BLOCK_M of
its rows and BLOCK_N output channels, and streams that slice once: gate_up finds its rows among the routed ids
itself (no sort, no host sync) and stores silu(gate) * up; down scales by the routing weight; combine sums a
token's k rows in float32 with the residual, one rounding. The grid depends only on the token count, so a graph
replays it for any routing. fp8 weights are dequantised in the kernel, or with fp8 activations (quantised once
per projection by `quantize_groups`, not per program) multiplied as e4m3 on the tensor cores."""

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the grouped GEMM and the loop remain
    triton = None

SCALE_NONE, SCALE_CHANNEL, SCALE_BLOCK = 0, 1, 2
MAX_TOKENS = 64  # longer steps take the grouped GEMM, which catches up once every expert has many rows
COMBINE_BLOCK = 128  # hidden columns per combining program


if triton is not None:

    @triton.jit
    def _expert_rows(ids_ptr, e, block, R, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
        """The `block`-th BLOCK_M routed rows (token * k + slot) that chose expert `e`, their mask, and whether any."""
        offs_r = tl.arange(0, R_PAD)
        hit = (tl.load(ids_ptr + offs_r, mask=offs_r < R, other=-1) == e).to(tl.int32)
        rank = tl.cumsum(hit, 0) - 1 + (1 - hit) * R_PAD  # a row's place among the expert's; others out of range
        slot = block * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.sum(tl.where(rank[None, :] == slot[:, None], offs_r[None, :], 0), axis=1)
        count = tl.sum(hit, 0)
        return rows, slot < count, block * BLOCK_M < count

    @triton.jit
    def _program_rows(ids_ptr, R, R_PAD: tl.constexpr, M_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
                      COMPACT: tl.constexpr):
        """This program's expert and rows; COMPACT: a program per routed row, its expert unless an earlier row's."""
        if COMPACT:
            first = tl.program_id(0) // M_BLOCKS
            e = tl.load(ids_ptr + first)
            offs_r = tl.arange(0, R_PAD)
            before = tl.sum((tl.load(ids_ptr + offs_r, mask=offs_r < first, other=-1) == e).to(tl.int32), 0)
            rows, m_mask, any_rows = _expert_rows(ids_ptr, e, tl.program_id(0) % M_BLOCKS, R, R_PAD, BLOCK_M)
            any_rows = any_rows & (before == 0)
        else:
            e = tl.program_id(0) // M_BLOCKS
            rows, m_mask, any_rows = _expert_rows(ids_ptr, e, tl.program_id(0) % M_BLOCKS, R, R_PAD, BLOCK_M)
        return e, rows, m_mask, any_rows

    @triton.jit
    def _quantize_rows(a, GRID_ROUND: tl.constexpr):
        """A [rows, 128] tile in e4m3 with a scale per row, as fp8.quantize_groups. GRID_ROUND: Triton's interpreter
        rounds wrongly across binades, so values are first rounded onto e4m3's grid in float32."""
        a = a.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12) / 448.0
        v = a / scale[:, None]
        if GRID_ROUND:
            binade = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(v), 1e-30))), -6.0)  # subnormals below 2^-6
            step = tl.exp2(binade - 3.0)  # three mantissa bits
            v = (v / step + 12582912.0 - 12582912.0) * step  # 1.5 * 2^23: rounds to an integer, ties to even
        return v.to(tl.float8e4nv), scale

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, s_ptr, R, stride_x, GROUPS: tl.constexpr, GRID_ROUND: tl.constexpr,
                         BLOCK_R: tl.constexpr):
        """x [R, GROUPS * 128] -> q (e4m3, same shape), s [R, GROUPS] float32; BLOCK_R rows of a group a program."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs = tl.program_id(1) * 128 + tl.arange(0, 128)
        mask = rows[:, None] < R
        q, scale = _quantize_rows(tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0), GRID_ROUND)
        tl.store(q_ptr + rows[:, None] * (GROUPS * 128) + offs[None, :], q, mask=mask)
        tl.store(s_ptr + rows * GROUPS + tl.program_id(1), scale, mask=rows < R)

    @triton.jit
    def _activations(v, DOT: tl.constexpr):
        """Activations in the dots' type, saturated for fp16: a bf16 value past its range would become inf."""
        if DOT == tl.float16:
            v = tl.minimum(tl.maximum(v.to(tl.float32), -65504.0), 65504.0)
        return v.to(DOT)

    @triton.jit
    def _gate_up_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, ids_ptr, out_ptr, R, H: tl.constexpr, I: tl.constexpr,
                        K_ROUTED: tl.constexpr, stride_x, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_out,
                        SCALE: tl.constexpr, DOT: tl.constexpr, A8: tl.constexpr, R_PAD: tl.constexpr,
                        M_BLOCKS: tl.constexpr, COMPACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        """silu(gate) * up of each routed row, into `out` [R, I] in its dtype."""
        e, rows, m_mask, any_rows = _program_rows(ids_ptr, R, R_PAD, M_BLOCKS, BLOCK_M, COMPACT)
        if any_rows:
            tok = rows // K_ROUTED
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = x_ptr + tok[:, None] * stride_x + offs_k[None, :]
            g_ptrs = w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
            u_ptrs = g_ptrs + I * stride_wn
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, H, BLOCK_K):
                if A8:  # e4m3 x e4m3: x quantised already, a scale per 128 channels
                    a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
                    s_a = tl.load(xs_ptr + tok * stride_xs + kk // 128, mask=m_mask, other=0.0)
                    pg = tl.dot(a, tl.trans(tl.load(g_ptrs)), out_dtype=tl.float32) * s_a[:, None]
                    pu = tl.dot(a, tl.trans(tl.load(u_ptrs)), out_dtype=tl.float32) * s_a[:, None]
                    if SCALE == 2:
                        pg *= tl.load(s_ptr + e * stride_se + (offs_n // 128) * stride_sn + kk // 128)[None, :]
                        pu *= tl.load(s_ptr + e * stride_se + ((offs_n + I) // 128) * stride_sn + kk // 128)[None, :]
                    acc_g += pg
                    acc_u += pu
                else:
                    a = _activations(tl.load(a_ptrs, mask=m_mask[:, None], other=0.0), DOT)
                    g = tl.load(g_ptrs).to(DOT)
                    u = tl.load(u_ptrs).to(DOT)
                    if SCALE == 2:  # one scale per 128 x 128 tile: BLOCK_N and BLOCK_K divide 128
                        s_g = tl.load(s_ptr + e * stride_se + (offs_n // 128) * stride_sn + kk // 128)
                        s_u = tl.load(s_ptr + e * stride_se + ((offs_n + I) // 128) * stride_sn + kk // 128)
                        acc_g += tl.dot(a, tl.trans(g)) * s_g[None, :]
                        acc_u += tl.dot(a, tl.trans(u)) * s_u[None, :]
                    else:
                        acc_g = tl.dot(a, tl.trans(g), acc_g)
                        acc_u = tl.dot(a, tl.trans(u), acc_u)
                a_ptrs += BLOCK_K
                g_ptrs += BLOCK_K
                u_ptrs += BLOCK_K
            if SCALE == 1:
                acc_g *= tl.load(s_ptr + e * stride_se + offs_n)[None, :]
                acc_u *= tl.load(s_ptr + e * stride_se + I + offs_n)[None, :]
            act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], act.to(out_ptr.dtype.element_ty),
                     mask=m_mask[:, None])

    @triton.jit
    def _down_kernel(a_ptr, as_ptr, w_ptr, s_ptr, ids_ptr, route_w_ptr, out_ptr, R, I: tl.constexpr, stride_a,
                     stride_as, stride_we, stride_wn, stride_se, stride_sn, stride_out, SCALE: tl.constexpr,
                     DOT: tl.constexpr, A8: tl.constexpr, R_PAD: tl.constexpr, M_BLOCKS: tl.constexpr,
                     COMPACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        e, rows, m_mask, any_rows = _program_rows(ids_ptr, R, R_PAD, M_BLOCKS, BLOCK_M, COMPACT)
        if any_rows:
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
            w_ptrs = w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, I, BLOCK_K):
                if A8:
                    a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
                    s_a = tl.load(as_ptr + rows * stride_as + kk // 128, mask=m_mask, other=0.0)
                    p = tl.dot(a, tl.trans(tl.load(w_ptrs)), out_dtype=tl.float32) * s_a[:, None]
                    if SCALE == 2:
                        p *= tl.load(s_ptr + e * stride_se + (offs_n // 128) * stride_sn + kk // 128)[None, :]
                    acc += p
                else:
                    a = _activations(tl.load(a_ptrs, mask=m_mask[:, None], other=0.0), DOT)
                    w = tl.load(w_ptrs).to(DOT)
                    if SCALE == 2:
                        s = tl.load(s_ptr + e * stride_se + (offs_n // 128) * stride_sn + kk // 128)
                        acc += tl.dot(a, tl.trans(w)) * s[None, :]
                    else:
                        acc = tl.dot(a, tl.trans(w), acc)
                a_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            if SCALE == 1:
                acc *= tl.load(s_ptr + e * stride_se + offs_n)[None, :]
            acc *= tl.load(route_w_ptr + rows, mask=m_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=m_mask[:, None])

    @triton.jit
    def _combine_kernel(y_ptr, res_ptr, out_ptr, H: tl.constexpr, K_ROUTED: tl.constexpr, HAS_RES: tl.constexpr,
                        BLOCK_H: tl.constexpr):
        """A token's k weighted rows summed in float32, plus the residual (HAS_RES): one kernel, not three."""
        t = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.static_range(K_ROUTED):
            acc += tl.load(y_ptr + (t * K_ROUTED + j) * H + offs_h)
        if HAS_RES:
            acc += tl.load(res_ptr + t * H + offs_h).to(tl.float32)
        tl.store(out_ptr + t * H + offs_h, acc.to(out_ptr.dtype.element_ty))


# A tile shape may carry `down`, the down kernel's own DOWN_KEYS (it reduces over the intermediate size); BLOCK_M
# and BLOCK_K are shared: both kernels take the same rows and 128-channel activation scales.
DOWN_KEYS = ("BLOCK_N", "num_warps", "num_stages")


def _tiles(tokens: int, fp8: bool = False, a8: bool = False, intermediate: int = 0) -> dict:
    """The tile shape for `tokens` tokens (docs/decisions.md); `a8` keeps K at 128, the activations' scale groups."""
    if tokens <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if a8 and tokens <= 64:
        return dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)
    if not fp8 and tokens <= 32 and intermediate >= 768:  # experts as wide as the thinker's; the talker's keep the next
        return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)


# fp8 weights meet the tensor cores as fp16: Hopper converts e4m3 to fp16 in one instruction, to bf16 in two
FP8_DOT = "float16"


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dot_type(scale: int):
    if FP8_DOT == "float16" and scale != SCALE_NONE:
        return tl.float16
    return tl.float32 if _interpreted() else tl.bfloat16


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
            block: int | None = None, residual: torch.Tensor | None = None, fp8_activations: bool = False) -> torch.Tensor:
    """x [T, H]; ids, weights [T, k]; gate_up [E, 2I, H]; down [E, H, I] -> [T, H]; fp8 scales [E, N] or per tile."""
    if triton is None:
        raise RuntimeError("the triton experts backend needs triton (GPU installs have it)")
    t, k = ids.shape
    n_exp = gate_up.shape[0]
    scale = SCALE_NONE if gate_up_scale is None else (SCALE_CHANNEL if block is None else SCALE_BLOCK)
    if scale == SCALE_BLOCK and block != 128:
        raise ValueError(f"tile scales of {block} x {block}: the kernels read 128 x 128 tiles")
    if fp8_activations and (scale == SCALE_NONE or gate_up.dtype != torch.float8_e4m3fn):
        raise ValueError("fp8 activations need e4m3 expert weights with their scales")
    cfg = dict(_tiles(t, scale != SCALE_NONE, fp8_activations, gate_up.shape[1] // 2))
    down_tiles = cfg.pop("down", {})
    if fp8_activations and cfg["BLOCK_K"] != 128:
        raise ValueError(f"fp8 activations are scaled per 128 channels: the kernels' K tile is {cfg['BLOCK_K']}")
    dot = _dot_type(scale)  # float32 in Triton's interpreter, whose bf16 dot is wrong
    a8 = int(fp8_activations)
    flat_ids = ids.reshape(-1).contiguous()
    m_blocks = triton.cdiv(t, cfg["BLOCK_M"])  # at most one row per token an expert (top-k ids are distinct)
    compact = t * k < n_exp  # a program per routed row: no program for an unchosen expert
    common = dict(SCALE=scale, DOT=dot, A8=a8, R_PAD=triton.next_power_of_2(t * k), M_BLOCKS=m_blocks, COMPACT=compact,
                  **cfg)
    programs = (t * k if compact else n_exp) * m_blocks
    return _launch(x, flat_ids, weights, gate_up, down, gate_up_scale, down_scale, residual, t, programs, common,
                   down_tiles)


QUANT_ROWS = 16  # rows per quantising program


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (e4m3 [R, K], float32 scales [R, K / 128]) in one kernel: fp8.quantize_groups's numbers."""
    r, k = x.shape
    if k % 128:
        raise ValueError(f"{k} channels do not split into groups of 128")
    x = x.contiguous()
    q = torch.empty(r, k, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(r, k // 128, device=x.device, dtype=torch.float32)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _quantize_kernel[(triton.cdiv(r, QUANT_ROWS), k // 128)](x, q, scale, r, x.stride(0), k // 128, _interpreted(),
                                                                 BLOCK_R=QUANT_ROWS)
    return q, scale


def _launch(x, flat_ids, weights, gate_up, down, gate_up_scale, down_scale, residual, t: int, programs: int,
            common: dict, down_tiles: dict | None = None) -> torch.Tensor:
    """`experts`' three kernels over `programs` row blocks, the down kernel with `down_tiles` over `common`."""
    k = flat_ids.numel() // t
    n_exp, two_i, h = gate_up.shape
    i, bk = two_i // 2, common["BLOCK_K"]
    if set(down_tiles or {}) - set(DOWN_KEYS):
        raise ValueError(f"the down kernel's own tiles are {DOWN_KEYS}, not {sorted(set(down_tiles) - set(DOWN_KEYS))}")
    down_common = {**common, **(down_tiles or {})}
    bn, dn = common["BLOCK_N"], down_common["BLOCK_N"]
    if h % bk or i % bk or i % bn or h % dn or h % COMBINE_BLOCK:
        raise ValueError(f"hidden {h} and intermediate {i} must be multiples of the tiles ({bn}, {dn}, {bk})")
    x, r = x.contiguous(), t * k
    act = torch.empty(r, i, device=x.device, dtype=x.dtype)  # silu(gate) * up, [R, I]
    y = torch.empty(r, h, device=x.device, dtype=torch.float32)  # weighted outputs, [R, H]
    su = gate_up_scale if gate_up_scale is not None else act  # unread when SCALE_NONE
    sd = down_scale if down_scale is not None else act
    su_n = su.stride(1) if su.dim() == 3 else 0
    sd_n = sd.stride(1) if sd.dim() == 3 else 0
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # Triton launches on the current device
        a, a_scale = quantize_groups(x) if common["A8"] else (x, act)  # act: unread
        _gate_up_kernel[(programs, i // bn)](
            a, a_scale, gate_up, su, flat_ids, act, r, h, i, k, a.stride(0), a_scale.stride(0), gate_up.stride(0),
            gate_up.stride(1), su.stride(0), su_n, act.stride(0), **common)
        a, a_scale = quantize_groups(act) if common["A8"] else (act, act)
        _down_kernel[(programs, h // dn)](
            a, a_scale, down, sd, flat_ids, weights.reshape(-1).contiguous(), y, r, i, a.stride(0), a_scale.stride(0),
            down.stride(0), down.stride(1), sd.stride(0), sd_n, y.stride(0), **down_common)
        out = torch.empty(t, h, device=x.device, dtype=x.dtype)
        res = residual.contiguous() if residual is not None else out  # unread without HAS_RES
        _combine_kernel[(t, h // COMBINE_BLOCK)](y, res, out, h, k, residual is not None, BLOCK_H=COMBINE_BLOCK)
    return out

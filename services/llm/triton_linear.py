"""Projections of a few rows (a decode step's) as one Triton kernel each, split over the reduction.

A decode step's projection is a read of its weight; cuBLAS's split-K adds a reduction kernel. Here each program
streams BLOCK_N channels of one of `split` slices of K for all rows and stores float32 partials [split, rows, N],
which the compiled caller sums into what follows (residual add, norm): one kernel. `split` depends only on the
weight's shape, so a dynamic row count sees one output shape per weight."""

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: callers keep F.linear
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (the tests)
MAX_ROWS = 64  # more rows go to cuBLAS, which then reads each weight tile for many rows


if triton is not None:

    @triton.jit
    def _partials_kernel(x_ptr, w_ptr, out_ptr, M, N, stride_x, stride_w, stride_os, K_SPLIT: tl.constexpr,
                         DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[s, m, n] = sum over k in slice s of x[m, k] * w[n, k] (float32); program (n block, slice s)."""
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.program_id(1) * K_SPLIT + tl.arange(0, BLOCK_K)
        m_mask, n_mask = offs_m < M, offs_n < N
        x_ptrs = x_ptr + offs_m[:, None] * stride_x + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None] * stride_w + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K_SPLIT, BLOCK_K):
            a = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0).to(DOT)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0).to(DOT)
            acc = tl.dot(a, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out = out_ptr + tl.program_id(1) * stride_os + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])


# The weight shapes (N, K) that beat cuBLAS (the thinker's output projection; q/k/v does not): docs/decisions.md
TILES: dict[tuple[int, int], dict] = {(2048, 4096): dict(split=4, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)}
DEFAULT = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
PROGRAMS = 256


def tiles(n: int, k: int) -> dict:
    """Split and tiles for a weight [n, k]: TILES's, else DEFAULT's, K split until PROGRAMS programs."""
    if (n, k) in TILES:
        return dict(TILES[n, k])
    cfg, blocks = dict(DEFAULT, split=1), -(-n // DEFAULT["BLOCK_N"])
    while blocks * cfg["split"] < PROGRAMS and k % (2 * cfg["split"] * cfg["BLOCK_K"]) == 0:
        cfg["split"] *= 2
    return cfg


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `partials` takes x @ w.T: at most MAX_ROWS rows, w's shape in TILES, both contiguous in K."""
    if triton is None or x.dim() != 2 or w.dim() != 2 or not (x.is_cuda or INTERPRET):
        return False
    n, k = int(w.shape[0]), int(w.shape[1])  # a weight's shape is constant under dynamic shapes
    return (n, k) in TILES and x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and w.stride(1) == 1


def partials(x: torch.Tensor, w: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), w [N, K] -> [split, M, N] float32 partial sums of x @ w.T over slices of K."""
    m, k = x.shape
    n = w.shape[0]
    cfg = dict(cfg or tiles(n, k))
    split = cfg.pop("split")
    if m > MAX_ROWS or k % (split * cfg["BLOCK_K"]):
        raise ValueError(f"partials: {m} rows (at most {MAX_ROWS}), K {k} in {split} slices of {cfg['BLOCK_K']}")
    out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    dot = tl.float32 if INTERPRET else tl.bfloat16  # the interpreter's bf16 dot is wrong
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), split)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # Triton launches on the current device
        _partials_kernel[grid](x, w, out, m, n, x.stride(0), w.stride(0), out.stride(0), K_SPLIT=k // split, DOT=dot,
                               BLOCK_M=max(16, triton.next_power_of_2(m)), **cfg)
    return out


if triton is not None:

    @torch.library.custom_op("omni::linear_partials", mutates_args=())
    def linear_partials(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`partials` as an opaque op: inductor fuses the sum of its output into what follows."""
        return partials(x, w)

    @linear_partials.register_fake
    def _(x, w):
        n, k = int(w.shape[0]), int(w.shape[1])
        return x.new_empty((tiles(n, k)["split"], x.shape[0], n), dtype=torch.float32)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w); where `usable`, through the partials, summed in float32 and rounded once."""
    if usable(x, w):
        return torch.ops.omni.linear_partials(x, w).sum(0).to(x.dtype)
    return torch.nn.functional.linear(x, w)

"""A decode step's router as two Triton kernels in place of moe.route's five ops: logits in slices of the hidden
size, then per token their sum, softmax and top-k by repeated arg-max."""

import contextlib

import torch

from services.llm.triton_moe import _interpreted, triton

if triton is not None:
    import triton.language as tl

ROUTE_BLOCK = 128  # hidden columns per routing program's slice
ROUTE_TOKENS = 16  # tokens per routing program (a tensor-core tile's rows)


if triton is not None:
    @triton.jit
    def _route_logits_kernel(x_ptr, w_ptr, part_ptr, T, stride_x, H: tl.constexpr, E: tl.constexpr,
                             DOT: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT: tl.constexpr):
        """Partial logits [T, H / SPLIT, E] float32: a slice per program spreads the router's weights over many."""
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        split = tl.program_id(1)
        offs_h = split * SPLIT + tl.arange(0, SPLIT)
        offs_e = tl.arange(0, E)
        xv = tl.load(x_ptr + offs_t[:, None] * stride_x + offs_h[None, :], mask=offs_t[:, None] < T, other=0.0)
        wv = tl.load(w_ptr + offs_e[None, :] * H + offs_h[:, None])  # [SPLIT, E]
        if DOT == tl.float32:  # full precision, not tf32
            acc = tl.dot(xv.to(DOT), wv.to(DOT), input_precision="ieee", out_dtype=tl.float32)
        else:
            acc = tl.dot(xv.to(DOT), wv.to(DOT), out_dtype=tl.float32)
        tl.store(part_ptr + (offs_t[:, None] * (H // SPLIT) + split) * E + offs_e[None, :], acc,
                 mask=offs_t[:, None] < T)

    @triton.jit
    def _route_top_kernel(part_ptr, ids_ptr, weights_ptr, ROUND_TYPE: tl.constexpr, E: tl.constexpr,
                          SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                          NORM: tl.constexpr):
        """A token's logits (rounded as F.linear would), softmax, top-k by repeated arg-max (lowest id on ties)."""
        t = tl.program_id(0)
        offs_e = tl.arange(0, E)
        offs_s = tl.arange(0, SPLITS_PAD)
        part = tl.load(part_ptr + (t * SPLITS + offs_s[:, None]) * E + offs_e[None, :], mask=offs_s[:, None] < SPLITS,
                       other=0.0)
        logits = tl.sum(part, axis=0).to(ROUND_TYPE).to(tl.float32)
        p = tl.exp(logits - tl.max(logits, 0))
        p = p / tl.sum(p, 0)
        offs_k = tl.arange(0, K_PAD)
        top_w = tl.zeros((K_PAD,), dtype=tl.float32)
        top_i = tl.zeros((K_PAD,), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, 0)
            idx = tl.min(tl.where(p == best, offs_e, E), 0)
            top_w = tl.where(offs_k == j, best, top_w)
            top_i = tl.where(offs_k == j, idx, top_i)
            p = tl.where(offs_e == idx, -1.0, p)
        if NORM:
            top_w = top_w / tl.sum(top_w, 0)
        tl.store(ids_ptr + t * TOP_K + offs_k, top_i.to(ids_ptr.dtype.element_ty), mask=offs_k < TOP_K)
        tl.store(weights_ptr + t * TOP_K + offs_k, top_w.to(weights_ptr.dtype.element_ty), mask=offs_k < TOP_K)


def route(x: torch.Tensor, gate_w: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], gate_w [E, H] -> ids [T, k] int64, weights [T, k]; E a power of two of at least 16 (a tile's width)."""
    if triton is None:
        raise RuntimeError("the triton experts backend needs triton (GPU installs have it)")
    t, h = x.shape
    e = gate_w.shape[0]
    if e & (e - 1) or e < 16 or h % ROUTE_BLOCK:
        raise ValueError(f"{e} experts and hidden {h}: the routing kernels need a power of two of at least 16 experts "
                         f"and a multiple of {ROUTE_BLOCK}")
    x, gate_w = x.contiguous(), gate_w.contiguous()
    splits = h // ROUTE_BLOCK
    part = torch.empty(t, splits, e, device=x.device, dtype=torch.float32)
    ids = torch.empty(t, top_k, device=x.device, dtype=torch.long)
    weights = torch.empty(t, top_k, device=x.device, dtype=x.dtype)
    round_type = {torch.float32: tl.float32, torch.float16: tl.float16}.get(x.dtype, tl.bfloat16)
    dot = tl.float32 if _interpreted() or x.dtype == torch.float32 else round_type
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _route_logits_kernel[(triton.cdiv(t, ROUTE_TOKENS), splits)](
            x, gate_w, part, t, x.stride(0), h, e, dot, BLOCK_T=ROUTE_TOKENS, SPLIT=ROUTE_BLOCK, num_warps=4)
        _route_top_kernel[(t,)](part, ids, weights, round_type, e, splits, triton.next_power_of_2(splits), top_k,
                                triton.next_power_of_2(top_k), norm_topk, num_warps=4)
    return ids, weights

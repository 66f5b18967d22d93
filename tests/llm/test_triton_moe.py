"""The experts' Triton kernels (services/llm/triton_moe.py) run here in Triton's CPU interpreter, in a child
process (the interpreter is chosen when the kernels are defined): bf16 and fp8 experts (per-channel and
128 x 128 tile scales; bf16 activations, or e4m3 activations scaled per row and 128 channels) against the
loop over experts on the same, dequantised, weights and equally quantised activations; the quantising kernel
against fp8.quantize_groups; the routing kernels against moe.route."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHILD = r"""
import json, sys
import torch
from services.llm import fp8, moe, triton_moe, triton_route

torch.manual_seed(0)
E, H, I, K = 8, 256, 256, 3  # the kernels' tiles: 64 channels by 128 of the reduction; two of them either way
out = {}


def bf16_case(t):
    # t tokens' inputs, distinct experts per token with their renormalised weights, bf16 experts' weights
    x = torch.randn(t, H).to(torch.bfloat16)
    w, ids = torch.topk(torch.randn(t, E).softmax(-1), K)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    return x, ids, w, (torch.randn(E, 2 * I, H) * 0.05).to(torch.bfloat16), (torch.randn(E, H, I) * 0.05).to(torch.bfloat16)


def a8_loop(x, ids, w, gate_up, down):
    # The loop over experts with each projection's input quantised to e4m3 per row and 128 channels, and
    # silu(gate) * up rounded to x's dtype between them, as the kernels store it.
    y = torch.zeros(x.shape[0], down.shape[1])
    xq = fp8.fake_quant_groups(x)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(ids == e)
        if len(tok):
            gate, up = (xq[tok] @ gate_up[e].T).chunk(2, dim=-1)
            act = (torch.nn.functional.silu(gate) * up).to(x.dtype)
            y.index_add_(0, tok, fp8.fake_quant_groups(act) @ down[e].T * w[tok, slot, None].float())
    return y


# One token and two (fewer routed rows than experts: a program per routed row, the two tokens sharing experts 0
# and 2 in different slots); under one tile of rows; over it; a second tile shape (BLOCK_M 32, two blocks).
for t in (1, 2, 5, 17, 40):
    x = torch.randn(t, H).to(torch.bfloat16)
    w, ids = torch.topk(torch.randn(t, E).softmax(-1), K)  # distinct experts per token, as a router gives
    if t == 2:
        ids = torch.tensor([[0, 1, 2], [2, 3, 0]])
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    gate_up = (torch.randn(E, 2 * I, H) * 0.05).to(torch.bfloat16)
    down = (torch.randn(E, H, I) * 0.05).to(torch.bfloat16)
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
    ref = moe.loop(x.float(), ids, w.float(), gate_up.float(), down.float())
    out[f"bf16/{t}"] = rel(triton_moe.experts(x, ids, w, gate_up, down), ref)
    residual = torch.randn(t, H).to(torch.bfloat16)  # the layer's residual stream, added in the combining kernel
    out[f"bf16+residual/{t}"] = rel(triton_moe.experts(x, ids, w, gate_up, down, residual=residual), ref + residual.float())
    for block in (None, 128):
        (gq, gs), (dq, ds) = fp8.quantize(gate_up, block), fp8.quantize(down, block)
        ref = moe.loop(x.float(), ids, w.float(), fp8.dequantize(gq, gs, block), fp8.dequantize(dq, ds, block))
        out[f"fp8-{block or 'channel'}/{t}"] = rel(triton_moe.experts(x, ids, w, gq, dq, gs, ds, block), ref)
        triton_moe.FP8_DOT = "bfloat16"  # the weights (and activations) converted to bf16 for the dots
        out[f"fp8-{block or 'channel'}-bf16dot/{t}"] = rel(triton_moe.experts(x, ids, w, gq, dq, gs, ds, block), ref)
        triton_moe.FP8_DOT = "float16"
        ref = a8_loop(x, ids, w, fp8.dequantize(gq, gs, block), fp8.dequantize(dq, ds, block))
        got = triton_moe.experts(x, ids, w, gq, dq, gs, ds, block, fp8_activations=True)
        out[f"fp8-{block or 'channel'}-a8/{t}"] = rel(got, ref)
# The down kernel on tiles of its own (N tile 128, as bench.moe's down sweep may choose), BLOCK_M and BLOCK_K shared.
default_tiles = triton_moe._tiles
triton_moe._tiles = lambda *_: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=2,
                                    down=dict(BLOCK_N=128, num_warps=2, num_stages=3))
for t in (2, 17):
    x, ids, w, gate_up, down = bf16_case(t)
    out[f"down-tiles-bf16/{t}"] = rel(triton_moe.experts(x, ids, w, gate_up, down),
                                      moe.loop(x.float(), ids, w.float(), gate_up.float(), down.float()))
    (gq, gs), (dq, ds) = fp8.quantize(gate_up, 128), fp8.quantize(down, 128)
    ref = a8_loop(x, ids, w, fp8.dequantize(gq, gs, 128), fp8.dequantize(dq, ds, 128))
    out[f"down-tiles-fp8-128-a8/{t}"] = rel(triton_moe.experts(x, ids, w, gq, dq, gs, ds, 128, fp8_activations=True), ref)
triton_moe._tiles = lambda *_: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=2, down=dict(BLOCK_K=64))
try:
    triton_moe.experts(x, ids, w, gate_up, down)
    out["down-tiles-refused"] = False
except ValueError as e:
    out["down-tiles-refused"] = "BLOCK_K" in str(e)
# K tiles of 256 (bench.moe --wide-tiles), two pipeline stages: the reduction of 256 in one turn of the loop; and the
# bf16 shape the thinker's experts take at 17 to 32 tokens (N tiles of 128, three stages).
for t, shape in ((17, dict(BLOCK_N=64, BLOCK_K=256, num_stages=2)), (33, dict(BLOCK_N=64, BLOCK_K=256, num_stages=2)),
                 (20, default_tiles(32, False, False, 768))):
    triton_moe._tiles = lambda *_, shape=shape: dict(dict(BLOCK_M=32, num_warps=4), **shape)
    x, ids, w, gate_up, down = bf16_case(t)
    out[f"wide-bf16-{shape['BLOCK_N']}x{shape['BLOCK_K']}/{t}"] = rel(triton_moe.experts(x, ids, w, gate_up, down),
                                moe.loop(x.float(), ids, w.float(), gate_up.float(), down.float()))
triton_moe._tiles = default_tiles
# Activations past fp16's range (the fp8 weights' dots are in fp16): saturated at 65,504, not inf.
x = torch.randn(2, H).to(torch.bfloat16)
x[0, :4] = 1e5
w, ids = torch.topk(torch.randn(2, E).softmax(-1), K)
w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
gate_up, down = (torch.randn(E, 2 * I, H) * 1e-4).to(torch.bfloat16), (torch.randn(E, H, I) * 0.05).to(torch.bfloat16)
(gq, gs), (dq, ds) = fp8.quantize(gate_up, None), fp8.quantize(down, None)
ref = moe.loop(x.float().clamp(-65504, 65504), ids, w.float(), fp8.dequantize(gq, gs, None), fp8.dequantize(dq, ds, None))
out["fp8-channel-fp16dot-saturated/2"] = rel(triton_moe.experts(x, ids, w, gq, dq, gs, ds), ref)
x = torch.randn(20, H).to(torch.bfloat16) * torch.logspace(-3, 3, 20)[:, None].to(torch.bfloat16)  # rows of every scale
x[3] = 0  # a zero row keeps a tiny scale
q, scale = triton_moe.quantize_groups(x)  # the fp8 activations' one quantising kernel
ref_q, ref_scale = fp8.quantize_groups(x)
out["quantize"] = {"q": torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), "scale": torch.equal(scale, ref_scale),
                   "dtypes": [str(q.dtype), str(scale.dtype)]}
for t, k, norm in ((1, 8, True), (7, 6, False), (40, 8, True)):  # the thinker's top-8 and the talker's top-6
    x = torch.randn(t, H).to(torch.bfloat16)
    gate = (torch.randn(128, H) * 0.05).to(torch.bfloat16)
    ids, w = triton_route.route(x, gate, k, norm)
    ref_ids, ref_w = moe.route(x, gate, k, norm)
    probs = torch.nn.functional.linear(x.float(), gate.float()).softmax(-1)
    kth = probs.topk(k).values[:, -1:]
    # Logits rounded to bf16 tie often and round differently with the order of summation: any top-k is right
    # whose experts all reach the k-th float32 probability less what one bf16 rounding of a logit (<= 3) moves it.
    out[f"route-{k}/{t}"] = {
        "distinct": all(len(set(r)) == k for r in ids.tolist()),
        "a_top_k": bool((probs.gather(1, ids) >= kth * (1 - 2 * 3 * 2 ** -8)).all()),
        "weights": (w.float().sort(-1).values - ref_w.float().sort(-1).values).abs().max().item(),
        "dtypes": [str(ids.dtype), str(w.dtype)],
    }
json.dump(out, sys.stdout)
"""


def test_triton_experts_equal_the_loop_over_experts():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    routes = {name: out.pop(name) for name in [n for n in out if n.startswith("route")]}
    assert out.pop("quantize") == {"q": True, "scale": True, "dtypes": ["torch.float8_e4m3fn", "torch.float32"]}
    assert out.pop("down-tiles-refused") is True  # only the N tile, warps and stages are the down kernel's own
    assert len(out) == 48 and len(routes) == 3
    # bf16 output and bf16 silu(gate) * up between the projections against a float32 loop: bf16 rounding.
    assert all(v < 1e-2 for name, v in out.items() if "a8" not in name), out
    # e4m3 activations: each projection alone matches to float32 rounding, but a bf16 rounding of silu(gate) * up
    # that differs moves the down projection's input by a whole e4m3 step where it sits at a rounding tie.
    assert all(v < 3e-2 for name, v in out.items() if "a8" in name), out
    for name, r in routes.items():
        assert r["distinct"] and r["a_top_k"] and r["dtypes"] == ["torch.int64", "torch.bfloat16"], (name, r)
        assert r["weights"] <= 2 ** -7, (name, r)  # bf16 roundings of (near) equal weights


def test_a_wrong_tile_size_is_refused():
    import torch

    from services.llm import triton_moe

    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    ids, w = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bfloat16)
    q = torch.zeros(2, 256, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="128 x 128"):
        triton_moe.experts(x, ids, w, q, q[:, :, :128], torch.ones(2, 4, 2), torch.ones(2, 2, 1), block=64)

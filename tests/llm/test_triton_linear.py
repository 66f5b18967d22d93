"""The few-row projections' Triton kernel (services/llm/triton_linear.py) in Triton's CPU interpreter, in a child
process (the interpreter is chosen when the kernel is defined): its partial sums against the float32 product, the
shapes it takes, and the layers' compiled attention pieces through it against the same pieces through F.linear."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHILD = r"""
import json
import torch
import torch.nn.functional as F
from services.llm import fusion, layers, triton_linear

torch.manual_seed(0)
out = {}
# Rows under a tile and over one; N past its last tile; K in 1, 2 and 4 slices of 128 or 64
for m, n, k, split, bk in ((1, 96, 256, 1, 128), (5, 80, 512, 2, 128), (33, 64, 512, 4, 64), (64, 40, 256, 2, 128)):
    x, w = torch.randn(m, k).to(torch.bfloat16), torch.randn(n, k).to(torch.bfloat16)
    cfg = dict(split=split, BLOCK_N=32, BLOCK_K=bk, num_warps=4, num_stages=2)
    p = triton_linear.partials(x, w, cfg)
    ref = x.double() @ w.double().T
    out[f"partials/{m}x{n}x{k}/{split}"] = [list(p.shape), str(p.dtype), (p.double().sum(0) - ref).abs().max().item()]
try:
    triton_linear.partials(torch.randn(2, 200), torch.randn(8, 200), dict(split=1, BLOCK_N=32, BLOCK_K=128))
    out["refused"] = False
except ValueError as e:
    out["refused"] = "K 200" in str(e)
# Only the shapes in TILES, and at most MAX_ROWS rows
triton_linear.TILES[(64, 256)] = dict(split=2, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
w = torch.randn(64, 256).to(torch.bfloat16)
out["usable"] = [triton_linear.usable(torch.randn(r, 256).to(torch.bfloat16), w) for r in (1, 64, 65)]
out["usable_other_shape"] = triton_linear.usable(torch.randn(4, 128).to(torch.bfloat16), torch.randn(64, 128).to(torch.bfloat16))

# The output projection's piece, compiled as the engines run it (fusion.fuse), through the kernel: the residual stream
# and normed output of the eager piece through F.linear (its product rounded to bf16, then added), bit for bit (float32
# dots here); the kernel run where the rows are few. (Inductor's CPU code keeps F.linear's product in float32 for the
# add, so the compiled piece through F.linear is not the reference here: on a GPU cuBLAS rounds it.)
fusion.fuse()
calls, partials = [], triton_linear.partials
triton_linear.partials = lambda x, w, cfg=None: calls.append(x.shape[0]) or partials(x, w, cfg)
x_w, norm_w = torch.randn(64, 256).to(torch.bfloat16), torch.randn(64).to(torch.bfloat16)
for rows in (3, 17, 80):
    x, attn = torch.randn(rows, 64).to(torch.bfloat16), torch.randn(rows, 256).to(torch.bfloat16)
    got = layers.post_attention(x, attn, x_w, norm_w, 1e-6)
    res = x + torch.nn.functional.linear(attn, x_w)
    want = res, layers.rms_norm.plain(res, norm_w, 1e-6)
    out[f"post_attention/{rows}"] = all(torch.equal(a, b) for a, b in zip(got, want))
out["kernel_rows"] = calls
print(json.dumps(out))
"""


def test_partials_and_the_compiled_output_projection_through_them():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (shape, dtype, err) in [(k, v) for k, v in out.items() if k.startswith("partials/")]:
        m, n, _ = (int(v) for v in name.split("/")[1].split("x"))
        assert shape == [int(name.split("/")[2]), m, n] and dtype == "torch.float32", (name, shape, dtype)
        assert err < 1e-3, (name, err)  # float32 sums of bf16 products (K up to 512, values near 1)
    assert out["refused"] is True
    assert out["usable"] == [True, True, False] and out["usable_other_shape"] is False
    assert out["post_attention/3"] and out["post_attention/17"]
    assert sorted(set(out["kernel_rows"])) == [3, 17]  # 80 rows: F.linear

"""One full-size MoE layer's experts by number of tokens, every way we can run them: bf16 through the grouped
GEMM and through our Triton kernels, fp8 (per-channel weights) through `torch._scaled_grouped_mm` (per-token
activations) and through the Triton kernels, fp8 with 128 x 128 tile scales through the Triton kernels, and
past the decode kernels' token counts the sorted Triton kernels (moe: triton_sorted), bf16 and fp8; fp8 also
with its weights converted to bf16 (`fp8_*`) or fp16 (`fp8_*_fp16`) for the dots (triton_moe.FP8_DOT). Time
per call replayed as a CUDA graph (as decode runs it), the weight bandwidth it reached, and each output's
difference from bf16 grouped; and up to the decode kernels' token count the router (logits, softmax, top-k):
triton_route.route against layers.route's torch ops. The torch parts are compiled as the engines compile them
(`--eager`: not, as every file before session 9 ran them). `--tiles` also times the Triton kernels' tile
shapes at each token count, and `--sorted-tiles` the sorted kernels'.

    python -m bench.moe --out bench/results/moe-1xh200.json
"""

import argparse
import itertools
import json
import time

import torch

from bench import results
from bench.graph_launch import capture
from services.llm import layers, triton_moe, triton_route
from services.llm.context import step_context
from services.llm.fp8 import Fp8Experts
from services.llm.layers import Experts, fuse
from services.model.load import load_config


def graph_ms(fn, iters: int) -> float:
    graph = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / iters


TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def timed_shapes(shapes, chooser: str, backend: str, x, ids, w, module, iters: int) -> list[dict]:
    """Each tile shape of `shapes` (tuples of TILE_KEYS' values, or whole dicts as the chooser returns them) put
    in place of triton_moe's `chooser` and timed under `backend`, fastest first (shapes that fail, e.g. past
    shared memory, last)."""
    default, timed = getattr(triton_moe, chooser), []
    for shape in shapes:
        cfg = shape if isinstance(shape, dict) else dict(zip(TILE_KEYS, shape))
        setattr(triton_moe, chooser, lambda *_, cfg=cfg: cfg)
        try:
            with step_context(None, backend):
                timed.append({**cfg, "ms": graph_ms(lambda: module(x, ids, w), iters)})
        except Exception as e:  # a shape that does not fit in shared memory: skip it
            timed.append({**cfg, "error": str(e)[:120]})
        finally:
            setattr(triton_moe, chooser, default)
    return sorted(timed, key=lambda c: c.get("ms", float("inf")))


def tile_sweep(n: int, x, ids, w, module, iters: int, wide: bool = False) -> tuple[list[dict], list[dict]]:
    """The decode kernels' tile shapes on a small grid at n tokens (bf16, fp8 per channel, or fp8 with e4m3
    activations), both kernels alike; then, from the fastest, the down kernel's own N tile, warps and stages
    (its reduction is 768 long where gate/up's is 2,048). Narrow N tiles are in it for the few tokens of small
    batches: at one token only the 8 chosen experts' programs have work (96 of gate_up's with N tiles of 64,
    fewer than the H200's 132 SMs), so more, narrower ones may keep more of the weights' bytes in flight.
    Returns (shapes, down kernel's shapes beside the best), each fastest first."""
    fp8 = isinstance(module, Fp8Experts)
    if fp8 and module.activations:  # e4m3 inputs are scaled per 128 channels: K tiles of 128; fp8 tiles are half
        # the bytes of bf16's, so wider N tiles and deeper pipelines fit the same shared memory
        shapes = [s for s in itertools.product((16, 32), (64, 128, 256), (128,), (4, 8), (3, 4)) if s[0] <= max(16, n)]
    elif wide:  # K tiles of 256 for bf16 too (rows of 512 bytes a load, half the loop's turns), and 2-stage pipelines
        shapes = [s for s in itertools.product((16, 32), (32, 64, 128), (128, 256), (4, 8), (2, 3, 4))
                  if s[0] <= max(16, n) and (s[0] == 32 or n <= 16)]
    else:
        shapes = [s for s in itertools.product((16, 32), (16, 32, 64, 128), (128, 256) if fp8 else (128,), (4, 8), (3, 5))
                  if s[0] <= max(16, n)]
    timed = timed_shapes(shapes, "_tiles", "triton", x, ids, w, module, iters)
    if "ms" not in timed[0]:
        return timed, []
    best = {key: timed[0][key] for key in TILE_KEYS}
    downs = [{**best, "down": dict(zip(triton_moe.DOWN_KEYS, s))}
             for s in itertools.product((32, 64, 128, 256), (4, 8), (3, 4, 5))
             if s != (best["BLOCK_N"], best["num_warps"], best["num_stages"])]
    return timed, timed_shapes([best, *downs], "_tiles", "triton", x, ids, w, module, iters)


def sorted_tile_sweep(n: int, x, ids, w, module, iters: int) -> list[dict]:
    """The sorted kernels' tile shapes at n tokens (moe: triton_sorted, bf16 or fp8 per channel)."""
    shapes = itertools.product((32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4))
    return timed_shapes(shapes, "_sorted_tiles", "triton_sorted", x, ids, w, module, iters)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default="1,8,32,64,128,512,2048")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tiles", default="", help="token counts at which to time the Triton tile shapes (e.g. 1,32)")
    p.add_argument("--tile-ways", default="bf16,fp8,fp8a8", help="whose tiles --tiles times: bf16, fp8 (bf16 inputs), fp8a8")
    p.add_argument("--sorted-tiles", default="", help="token counts at which to time the sorted kernels' tiles (e.g. 512)")
    p.add_argument("--wide-tiles", action="store_true",
                   help="--tiles for bf16 and fp8 with bf16 inputs over K tiles of 128 and 256 and 2 to 4 stages (BLOCK_M 32 past 16 tokens)")
    p.add_argument("--eager", action="store_true", help="the grouped path's glue uncompiled (before session 9 it always was)")
    args = p.parse_args(argv)
    if not args.eager:
        fuse()  # the grouped path (and torch's routing) compiled, as the engines run them with compile: true
    tc = load_config(None).thinker_config.text_config
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    with dev:
        experts = Experts(tc.hidden_size, tc.num_experts, tc.moe_intermediate_size).to(torch.bfloat16)
        gate = torch.empty(tc.num_experts, tc.hidden_size, dtype=torch.bfloat16)
    for p_ in [*experts.parameters(), gate]:
        p_.data.normal_(0, 0.02, generator=gen)
    channel, block = Fp8Experts(experts, None), Fp8Experts(experts, 128)
    ways = {  # name: (module, experts backend, bytes per weight)
        "bf16_grouped": (experts, "grouped", 2), "bf16_triton": (experts, "triton", 2),
        "fp8_grouped": (channel, "grouped", 1), "fp8_triton": (channel, "triton", 1), "fp8block_triton": (block, "triton", 1),
        # the sorted kernels (moe: triton_sorted) for steps past the decode kernels' MAX_TOKENS
        "bf16_sorted": (experts, "triton_sorted", 2), "fp8_sorted": (channel, "triton_sorted", 1),
        # fp8 weights converted to fp16, not bf16, for the dots (triton_moe.FP8_DOT)
        "fp8_triton_fp16": (channel, "triton", 1), "fp8_sorted_fp16": (channel, "triton_sorted", 1),
        # e4m3 activations too (per token and 128 channels, quantised once per projection), fp8 tensor cores
        "fp8a8_triton": (Fp8Experts(experts, None, activations=True), "triton", 1),
        "fp8blocka8_triton": (Fp8Experts(experts, 128, activations=True), "triton", 1),
    }
    result = results.new_result("moe", {"experts": tc.num_experts, "top_k": tc.num_experts_per_tok, "hidden": tc.hidden_size,
                                        "intermediate": tc.moe_intermediate_size}, {}, {"args": vars(args)})
    result["machine"] = results.machine()
    tiles_at = {int(t) for t in args.tiles.split(",") if t}
    sorted_tiles_at = {int(t) for t in args.sorted_tiles.split(",") if t}
    per_expert = 3 * tc.hidden_size * tc.moe_intermediate_size
    default_dot = triton_moe.FP8_DOT
    for n in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(n, tc.hidden_size, device=dev, dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(n, tc.num_experts, device=dev, generator=gen)
        w, ids = logits.softmax(-1).topk(tc.num_experts_per_tok, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
        touched = ids.unique().numel()  # the call must read every expert some token chose, all three projections
        cell = {"tokens": n, "experts_touched": touched, "status": "ok"}
        with torch.no_grad():
            with step_context(None, "grouped"):
                ref = experts(x, ids, w).float()
            for name, (module, backend, width) in ways.items():
                if backend == "triton" and n > 2 * triton_moe.MAX_TOKENS and name != "fp8block_triton":
                    continue  # the engine runs the grouped GEMM there (tile-scaled experts: dequantised tiles)
                if backend == "triton_sorted" and not triton_moe.MAX_TOKENS < n <= triton_moe.SORTED_MAX_TOKENS:
                    continue  # the decode kernels below, the grouped GEMM above
                triton_moe.FP8_DOT = "float16" if name.endswith("_fp16") else "bfloat16"
                try:
                    with step_context(None, backend):
                        out = module(x, ids, w).float()
                        ms = graph_ms(lambda: module(x, ids, w), args.iters)
                finally:
                    triton_moe.FP8_DOT = default_dot
                cell[f"{name}_ms"] = ms
                cell[f"{name}_weight_GBps"] = touched * per_expert * width / ms / 1e6
                cell[f"{name}_rel_l2"] = ((out - ref).norm() / ref.norm()).item()
            if n <= triton_moe.MAX_TOKENS:  # the router, as decode runs it
                k = tc.num_experts_per_tok
                cell["route_triton_ms"] = graph_ms(lambda: triton_route.route(x, gate, k, tc.norm_topk_prob), args.iters)
                cell["route_torch_ms"] = graph_ms(lambda: layers.OPS["route"](x, gate, k, tc.norm_topk_prob), args.iters)
                got, want = triton_route.route(x, gate, k, tc.norm_topk_prob)[0], layers.route(x, gate, k, tc.norm_topk_prob)[0]
                cell["route_same_experts"] = (got.sort(-1).values == want.sort(-1).values).all(-1).float().mean().item()
            if n in tiles_at:
                for way in args.tile_ways.split(","):
                    module = {"bf16": experts, "fp8": channel, "fp8a8": ways["fp8a8_triton"][0]}[way]
                    shapes, downs = tile_sweep(n, x, ids, w, module, args.iters, args.wide_tiles)
                    cell[f"tiles_{way}"], cell[f"down_tiles_{way}"] = shapes[:6], downs[:6]
            if n in sorted_tiles_at:
                cell["sorted_tiles_bf16"] = sorted_tile_sweep(n, x, ids, w, experts, args.iters)[:6]
                cell["sorted_tiles_fp8"] = sorted_tile_sweep(n, x, ids, w, channel, args.iters)[:6]
        cell["speedup_fp8_triton"] = cell["bf16_grouped_ms"] / cell.get("fp8_triton_ms", cell["fp8_grouped_ms"])
        result["cells"].append(cell)
        print(json.dumps(cell), flush=True)
        results.write(result, args.out)
    return result


if __name__ == "__main__":
    main()

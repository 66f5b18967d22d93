"""One full-size MoE layer's experts by number of tokens, every way the engines run them (bf16 and fp8 per channel
through the grouped GEMM and our Triton kernels, fp8 in 128 x 128 tiles, fp8 with e4m3 activations): time per call
replayed as a CUDA graph, the weight bandwidth reached, each output's difference from bf16 grouped; up to the
decode kernels' token count also the router. `--tiles`: the Triton kernels' tile shapes timed at those counts.

    python -m bench.moe --out bench/results/moe-1xh200-COMMIT.json
"""

import argparse
import itertools
import json
import time

import torch

from bench import results
from services.llm import moe, triton_moe, triton_route
from services.llm.context import step_context
from services.llm.fp8 import Fp8Experts
from services.llm.fusion import fuse
from services.llm.moe import Experts
from services.model.load import load_config

TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def capture(body) -> "torch.cuda.CUDAGraph":
    """`body` recorded as a graph on a side stream, after one run outside it (kernels compiled and chosen)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        body()
    return graph


def graph_ms(fn, iters: int) -> float:
    """Milliseconds a replay of `fn` captured as a graph, over `iters` replays back to back."""
    graph = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / iters


def timed_shapes(shapes, x, ids, w, module, iters: int) -> list[dict]:
    """Each tile shape (tuples of TILE_KEYS' values, or dicts as triton_moe._tiles returns them) put in place of
    triton_moe's choice and timed, fastest first (shapes that fail, e.g. past shared memory, last)."""
    default, timed = triton_moe._tiles, []
    for shape in shapes:
        cfg = shape if isinstance(shape, dict) else dict(zip(TILE_KEYS, shape))
        triton_moe._tiles = lambda *_, cfg=cfg: cfg
        try:
            with step_context(None, "triton"):
                timed.append({**cfg, "ms": graph_ms(lambda: module(x, ids, w), iters)})
        except Exception as e:  # a shape that does not fit in shared memory: skip it
            timed.append({**cfg, "error": str(e)[:120]})
        finally:
            triton_moe._tiles = default
    return sorted(timed, key=lambda c: c.get("ms", float("inf")))


def tile_sweep(n: int, x, ids, w, module, iters: int) -> tuple[list[dict], list[dict]]:
    """The decode kernels' tile shapes on a small grid at n tokens, both kernels alike; then, from the fastest,
    the down kernel's own N tile, warps and stages (its reduction is 768 long where gate/up's is 2,048).
    Returns (shapes, down kernel's shapes beside the best), each fastest first."""
    fp8 = isinstance(module, Fp8Experts)
    if fp8 and module.activations:  # e4m3 inputs are scaled per 128 channels: K tiles of 128
        shapes = itertools.product((16, 32), (64, 128, 256), (128,), (4, 8), (3, 4))
    else:
        shapes = itertools.product((16, 32), (16, 32, 64, 128), (128, 256) if fp8 else (128,), (4, 8), (3, 5))
    timed = timed_shapes([s for s in shapes if s[0] <= max(16, n)], x, ids, w, module, iters)
    if "ms" not in timed[0]:
        return timed, []
    best = {key: timed[0][key] for key in TILE_KEYS}
    downs = [{**best, "down": dict(zip(triton_moe.DOWN_KEYS, s))}
             for s in itertools.product((32, 64, 128, 256), (4, 8), (3, 4, 5))
             if s != (best["BLOCK_N"], best["num_warps"], best["num_stages"])]
    return timed, timed_shapes([best, *downs], x, ids, w, module, iters)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default="1,8,32,64,128,512,2048")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tiles", default="", help="token counts at which to time the Triton tile shapes (e.g. 1,32)")
    p.add_argument("--tile-ways", default="bf16,fp8,fp8a8", help="whose tiles --tiles times: bf16, fp8 (bf16 inputs), fp8a8")
    args = p.parse_args(argv)
    fuse()  # the grouped path (and torch's routing) compiled, as the engines run them
    tc = load_config(None).thinker_config.text_config
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    with dev:
        experts = Experts(tc.hidden_size, tc.num_experts, tc.moe_intermediate_size).to(torch.bfloat16)
        gate = torch.empty(tc.num_experts, tc.hidden_size, dtype=torch.bfloat16)
    for p_ in [*experts.parameters(), gate]:
        p_.data.normal_(0, 0.02, generator=gen)
    channel = Fp8Experts(experts, None)
    ways = {  # name: (module, experts backend, bytes per weight)
        "bf16_grouped": (experts, "grouped", 2), "bf16_triton": (experts, "triton", 2),
        "fp8_grouped": (channel, "grouped", 1), "fp8_triton": (channel, "triton", 1),
        "fp8block_triton": (Fp8Experts(experts, 128), "triton", 1),
        # e4m3 activations too (per token and 128 channels, quantised once per projection), fp8 tensor cores
        "fp8a8_triton": (Fp8Experts(experts, None, activations=True), "triton", 1),
        "fp8blocka8_triton": (Fp8Experts(experts, 128, activations=True), "triton", 1),
    }
    result = results.new_result("moe", {"experts": tc.num_experts, "top_k": tc.num_experts_per_tok, "hidden": tc.hidden_size,
                                        "intermediate": tc.moe_intermediate_size}, {}, {"args": vars(args)})
    result["machine"] = results.machine()
    tiles_at = {int(t) for t in args.tiles.split(",") if t}
    per_expert = 3 * tc.hidden_size * tc.moe_intermediate_size
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
                with step_context(None, backend):
                    out = module(x, ids, w).float()
                    ms = graph_ms(lambda: module(x, ids, w), args.iters)
                cell[f"{name}_ms"] = ms
                cell[f"{name}_weight_GBps"] = touched * per_expert * width / ms / 1e6
                cell[f"{name}_rel_l2"] = ((out - ref).norm() / ref.norm()).item()
            if n <= triton_moe.MAX_TOKENS:  # the router, as decode runs it
                k = tc.num_experts_per_tok
                cell["route_triton_ms"] = graph_ms(lambda: triton_route.route(x, gate, k, tc.norm_topk_prob), args.iters)
                cell["route_torch_ms"] = graph_ms(lambda: moe.route(x, gate, k, tc.norm_topk_prob), args.iters)
                got, want = triton_route.route(x, gate, k, tc.norm_topk_prob)[0], moe.route(x, gate, k, tc.norm_topk_prob)[0]
                cell["route_same_experts"] = (got.sort(-1).values == want.sort(-1).values).all(-1).float().mean().item()
            if n in tiles_at:
                for way in args.tile_ways.split(","):
                    module = {"bf16": experts, "fp8": channel, "fp8a8": ways["fp8a8_triton"][0]}[way]
                    shapes, downs = tile_sweep(n, x, ids, w, module, args.iters)
                    cell[f"tiles_{way}"], cell[f"down_tiles_{way}"] = shapes[:6], downs[:6]
        result["cells"].append(cell)
        print(json.dumps(cell), flush=True)
        results.write(result, args.out)
    return result


if __name__ == "__main__":
    main()

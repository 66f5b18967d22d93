"""One full-size MoE layer's experts, bf16 grouped GEMM against fp8 (per-channel weights, per-token
activations), by number of tokens: time per call (replayed as a CUDA graph, as decode runs it) and the
output difference.

    python -m bench.moe --out bench/results/moe-1xh200.json
"""

import argparse
import json
import time

import torch

from bench import results
from services.llm.context import step_context
from services.llm.fp8 import Fp8Experts
from services.llm.layers import Experts
from services.model.load import load_config


def graph_ms(fn, iters: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / iters


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default="1,8,32,64,128,512,2048")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    tc = load_config(None).thinker_config.text_config
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    with dev:
        experts = Experts(tc.hidden_size, tc.num_experts, tc.moe_intermediate_size).to(torch.bfloat16)
    for p_ in experts.parameters():
        p_.data.normal_(0, 0.02, generator=gen)
    fp8 = Fp8Experts(experts, None)
    result = results.new_result("moe", {"experts": tc.num_experts, "top_k": tc.num_experts_per_tok, "hidden": tc.hidden_size,
                                        "intermediate": tc.moe_intermediate_size}, {}, {"args": vars(args)})
    result["machine"] = results.machine()
    for n in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(n, tc.hidden_size, device=dev, dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(n, tc.num_experts, device=dev, generator=gen)
        w, ids = logits.softmax(-1).topk(tc.num_experts_per_tok, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
        with torch.no_grad(), step_context(None, "grouped"):
            ref, out = experts(x, ids, w).float(), fp8(x, ids, w).float()
            bf16_ms = graph_ms(lambda: experts(x, ids, w), args.iters)
            fp8_ms = graph_ms(lambda: fp8(x, ids, w), args.iters)
        # Weight bytes the call must read: every expert some token chose, all three projections.
        touched = ids.unique().numel()
        per_expert = 3 * tc.hidden_size * tc.moe_intermediate_size
        cell = {"tokens": n, "bf16_ms": bf16_ms, "fp8_ms": fp8_ms, "speedup": bf16_ms / fp8_ms, "experts_touched": touched,
                "bf16_weight_GBps": touched * per_expert * 2 / bf16_ms / 1e6, "fp8_weight_GBps": touched * per_expert / fp8_ms / 1e6,
                "rel_l2_diff": ((out - ref).norm() / ref.norm()).item(), "status": "ok"}
        result["cells"].append(cell)
        print(json.dumps(cell), flush=True)
        results.write(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""The grouped experts of one full-size layer at prompt sizes, compiled as the engines compile them, with the
routed rows gathered inside the compiled code (`fused`: inductor's own gather, as every run before session 13)
or by ATen's gather outside it (`aten`: moe.take, as now), in bf16 and in fp8 (per-channel weights, per-token
activations). Time per call, each output's difference from its eager form, and the kernels that took most.

    python -m bench.gather --tokens 2048 --out bench/results/gather-1xh200.json
"""

import argparse

import torch
import torch._inductor.config as inductor
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench import results
from services.llm import fp8, moe
from services.model.load import load_config


def bf16_fused(x, ids, weights, gate_up, down):
    order, offs = moe.by_expert(ids, gate_up.shape[0])
    h = torch._grouped_mm(x[order // ids.shape[1]], gate_up.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)
    return moe.combine(y, order, weights, x.dtype)


def fp8_fused(x, ids, weights, gate_up, gate_up_scale, down, down_scale):
    order, offs = moe.by_expert(ids, gate_up.shape[0])
    tok = order // ids.shape[1]
    xq, xs = fp8.quantize_tokens(x)
    h = torch._scaled_grouped_mm(xq[tok], gate_up.transpose(1, 2), xs[tok, 0], gate_up_scale, offs=offs, out_dtype=torch.bfloat16)
    gate, up = h.chunk(2, dim=-1)
    aq, a_scale = fp8.quantize_tokens(F.silu(gate) * up)
    y = torch._scaled_grouped_mm(aq, down.transpose(1, 2), a_scale[:, 0], down_scale, offs=offs, out_dtype=torch.bfloat16)
    return moe.combine(y, order, weights, x.dtype)


def timed(fn, args: tuple, iters: int) -> tuple[float, list[dict]]:
    for _ in range(3):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn(*args)
        torch.cuda.synchronize()
    kernels = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:6]
    return start.elapsed_time(end) / iters, [{"kernel": e.key[:120], "us_per_call": e.self_device_time_total / 5} for e in kernels]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default="512,2048")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    inductor.emulate_precision_casts = True  # as layers.fuse() sets it
    tc = load_config(None).thinker_config.text_config
    e, h, i, k = tc.num_experts, tc.hidden_size, tc.moe_intermediate_size, tc.num_experts_per_tok
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    gate_up = torch.randn(e, 2 * i, h, device=dev, generator=gen).mul_(0.02).bfloat16()
    down = torch.randn(e, h, i, device=dev, generator=gen).mul_(0.02).bfloat16()
    (gq, gs), (dq, ds) = fp8.quantize(gate_up), fp8.quantize(down)
    ways = {"bf16 fused": (bf16_fused, moe.grouped, (gate_up, down)), "bf16 aten": (moe.grouped, moe.grouped, (gate_up, down)),
            "fp8 fused": (fp8_fused, fp8.grouped, (gq, gs, dq, ds)), "fp8 aten": (fp8.grouped, fp8.grouped, (gq, gs, dq, ds))}
    result = results.new_result("gather", {"experts": e, "top_k": k, "hidden": h, "intermediate": i}, {}, {"args": vars(args)})
    result["machine"] = results.machine()
    for n in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(n, h, device=dev, generator=gen).bfloat16()
        ids = torch.rand(n, e, device=dev, generator=gen).argsort(-1)[:, :k]  # k distinct experts a token
        weights = torch.rand(n, k, device=dev, generator=gen).bfloat16()
        with torch.no_grad():
            for name, (fn, eager, weights_args) in ways.items():
                torch._dynamo.reset()
                call = (x, ids, weights, *weights_args)
                ref = eager(*call).float()
                ms, kernels = timed(torch.compile(fn, dynamic=True), call, args.iters)
                err = ((torch.compile(fn, dynamic=True)(*call).float() - ref).norm() / ref.norm()).item()
                result["cells"].append({"tokens": n, "way": name, "ms": ms, "rel_err_vs_eager": err, "kernels": kernels, "status": "ok"})
                print(f"{n:5d} tokens  {name:10s} {ms:.3f} ms a layer  rel err vs eager {err:.1e}  top kernel "
                      f"{kernels[0]['kernel'][:60]} {kernels[0]['us_per_call']:.0f} us", flush=True)
    print(f"wrote {results.write(result, args.out)}")


if __name__ == "__main__":
    main()

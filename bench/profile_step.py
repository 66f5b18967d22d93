"""Where a step's time goes: cProfile of the host and torch.profiler's view of both sides, for one batch size on
the config's engine: the thinker's decode steps at a prompt length, the talker's frame steps (fed synthetic thinker
states), or thinker-prefill (each step `batch` fresh requests taken to their first token, its wall time printed).
On a GPU also the device's timeline: each stream's busy time, and the time anything ran (the rest it waited on the
host); with --trace, the chrome trace.

    python -m bench.profile_step --config configs/bench-1xh200-mesh.yaml --stage thinker --batch 32 --steps 8
    python -m bench.profile_step --config configs/bench-1xh200-mesh.yaml --stage talker --batch 32 --rows 45
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from bench.stages import THINKER_SAMPLING, random_prompts
from bench.talker import TalkerFeed
from services.llm.sampling import SamplingParams
from services.runtime.config import load_config


def thinker(cfg, args, walls: list):
    """The thinker's engine and its step: `batch` requests past their prompts, a decode step of them each call; or,
    for thinker-prefill, `batch` fresh requests taken to their first token each call, then freed."""
    from services.thinker.seq import ThinkerSeq
    from services.thinker.server import make_engine

    engine, prompt = make_engine(cfg, cfg.replicas("thinker")[0].device), random_prompts(cfg, 0)

    def batch(tokens: int) -> list:
        seqs = [ThinkerSeq(f"p{len(walls)}-{i}", prompt(i, args.prompt_len),
                           SamplingParams(max_tokens=tokens, seed=i + 1, **THINKER_SAMPLING)) for i in range(args.batch)]
        for s in seqs:
            engine.add(s)
        while any(not s.generated for s in seqs):
            engine.step([s for s in seqs if engine.ready(s)])
        return seqs

    def prefill():
        t0 = time.perf_counter()
        seqs = batch(4)
        walls.append(time.perf_counter() - t0)
        for s in seqs:
            engine.free(s)

    if args.stage == "thinker-prefill":
        return engine, prefill
    seqs = batch(3 * args.steps + 4)
    return engine, lambda: engine.step(seqs)


def talker(cfg, args, walls: list):
    """The talker's engine and its frame step over `batch` speech requests past their prompts."""
    from services.talker.server import make_engine

    engine = make_engine(cfg, cfg.replicas("talker")[0].device)
    seqs = TalkerFeed(engine, cfg, 0, 32).batch(args.batch, 3 * args.steps + 4)
    engine.step([s for s in seqs if engine.ready(s)])  # every prompt
    return engine, lambda: engine.step([s for s in seqs if engine.ready(s)])


def timeline(spans: list[tuple[int, int, int]]) -> dict:
    """The device's timeline from its activities' (stream, start, end) (any one clock): per stream its busy time
    (the union of its activities) and count; across streams the span from the first start to the last end, the
    time anything ran (union), and the sum of the streams' busy times (above the union where streams overlapped)."""
    def union(intervals) -> int:
        total, end = 0, None
        for a, b in sorted(intervals):
            if end is None or a > end:
                total, end = total + b - a, b
            elif b > end:
                total, end = total + b - end, b
        return total

    streams: dict[int, list[tuple[int, int]]] = {}
    for stream, a, b in spans:
        streams.setdefault(stream, []).append((a, b))
    if not spans:
        return {"streams": {}, "span": 0, "busy": 0, "busy_sum": 0}
    per = {k: {"busy": union(v), "activities": len(v)} for k, v in sorted(streams.items())}
    return {"streams": per, "span": max(b for _, _, b in spans) - min(a for _, a, _ in spans),
            "busy": union((a, b) for _, a, b in spans), "busy_sum": sum(v["busy"] for v in per.values())}


def device_spans(tp) -> list[tuple[int, int, int]]:
    """(stream, start ns, end ns) of every kernel, copy and fill the profiler saw on a GPU."""
    return [(e.device_resource_id(), e.start_ns(), e.end_ns()) for e in tp.profiler.kineto_results.events()
            if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--stage", choices=["thinker", "talker", "thinker-prefill"], default="thinker")
    p.add_argument("--sort", default="tottime", help="the host profile's order: tottime, or cumulative (callers with callees)")
    p.add_argument("--trace", help="also write the profiled steps' chrome trace here (a GPU's timeline, kernel by kernel)")
    args = p.parse_args(argv)
    walls: list[float] = []  # thinker-prefill's rounds
    engine, step = (talker if args.stage == "talker" else thinker)(load_config(args.config, args.set), args, walls)
    for _ in range(args.steps):  # warm
        step()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    if walls:
        print(f"prefill of {args.batch} x {args.prompt_len} tokens to the first token: p50 "
              f"{statistics.median(walls[args.steps:]) * 1e3:.1f} ms over {args.steps} rounds (under cProfile)")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(args.sort).print_stats(args.rows)
    print(out.getvalue())
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as tp:
        for _ in range(args.steps):
            step()
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if torch.cuda.is_available():
        print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
        t = timeline(device_spans(tp))
        ms = lambda ns: f"{ns / 1e6:.2f} ms"  # noqa: E731
        print(f"device timeline over {args.steps} steps: span {ms(t['span'])}, something running {ms(t['busy'])} "
              f"({t['busy'] / max(t['span'], 1):.0%}), the streams' busy times summed {ms(t['busy_sum'])}")
        for stream, v in t["streams"].items():
            print(f"  stream {stream}: busy {ms(v['busy'])} in {v['activities']} kernels and copies")
    if args.trace:
        tp.export_chrome_trace(args.trace)
    return engine


if __name__ == "__main__":
    main()

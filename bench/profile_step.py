"""Where a decode step's time goes: cProfile of the host side and torch.profiler's view of both sides, for
one batch size, on the config's engine (overrides as in bench.stages): the thinker's steps at a prompt
length, or the talker's frame steps (talker, code predictor, code2wav) fed synthetic thinker states.

    python -m bench.profile_step --config configs/bench-1xh200.yaml --set thinker.engine=native --batch 64
    python -m bench.profile_step --config configs/bench-1xh200.yaml --stage talker --set talker.engine=native --batch 32
    python -m bench.profile_step --config configs/bench-1xh200.yaml --stage thinker-prefill --set thinker.engine=native \
        --batch 1 --prompt-len 40

thinker-prefill: each profiled step is `batch` fresh requests of `prompt-len` tokens taken to their first
token (the prefill a request's time to first token waits for), its wall time printed per round.

On a GPU, also the device's timeline over the profiled steps: per stream, its kernels' and copies' busy time and
span, and across streams the time anything ran, so what the device spent idle (waiting on the host) and what ran
side by side (code2wav's stream beside the frame loop's) show; with --trace, the whole chrome trace too.
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


def thinker(cfg, args):
    """The thinker's engine and `batch` requests past their prompts."""
    from services.thinker.reference import ThinkerSeq
    from services.thinker.server import make_engine

    engine = make_engine(cfg, cfg.thinker.replicas[0].device)
    prompt = random_prompts(cfg, 0)
    seqs = [ThinkerSeq(f"p{i}", prompt(i, args.prompt_len),
                       SamplingParams(max_tokens=3 * args.steps + 4, seed=i + 1, **THINKER_SAMPLING)) for i in range(args.batch)]
    for s in seqs:
        engine.add(s)
    while any(not s.generated for s in seqs):
        engine.step(seqs)
    return engine, seqs


def talker(cfg, args):
    """The talker's engine and `batch` speech requests past their prompts, with frames for every step to come."""
    from services.talker.server import make_engine

    engine = make_engine(cfg, cfg.talker.replicas[0].device)
    seqs = TalkerFeed(engine, cfg, 0, 32).batch(args.batch, 3 * args.steps + 4)
    engine.step(ready(engine, seqs))  # every prompt
    return engine, seqs


class Prefills:
    """thinker-prefill's step: fresh requests each time, stepped to their first token, then freed."""

    def __init__(self, cfg, args):
        from services.thinker.server import make_engine

        self.engine = make_engine(cfg, cfg.thinker.replicas[0].device)
        self.args, self.prompt, self.n, self.walls = args, random_prompts(cfg, 0), 0, []

    def step(self, _=None) -> None:
        from services.thinker.reference import ThinkerSeq

        a, engine = self.args, self.engine
        seqs = [ThinkerSeq(f"r{self.n}-{i}", self.prompt(i, a.prompt_len),
                           SamplingParams(max_tokens=4, seed=i + 1, **THINKER_SAMPLING)) for i in range(a.batch)]
        self.n += 1
        t0 = time.perf_counter()
        for s in seqs:
            engine.add(s)
        while any(not s.generated for s in seqs):
            engine.step([s for s in seqs if engine.ready(s)])
        self.walls.append(time.perf_counter() - t0)
        for s in seqs:
            engine.free(s)

    def ready(self, _):
        return None


def ready(engine, seqs) -> list:
    return [s for s in seqs if engine.ready(s)]


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
    cfg = load_config(args.config, args.set)
    if args.stage == "thinker-prefill":
        engine = Prefills(cfg, args)
        seqs = []
    else:
        engine, seqs = (talker if args.stage == "talker" else thinker)(cfg, args)
    for _ in range(args.steps):  # warm
        engine.step(ready(engine, seqs))
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step(ready(engine, seqs))
    prof.disable()
    if args.stage == "thinker-prefill":
        walls = engine.walls[args.steps:]
        print(f"prefill of {args.batch} x {args.prompt_len} tokens to the first token: p50 "
              f"{statistics.median(walls) * 1e3:.1f} ms over {len(walls)} rounds (under cProfile)")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(args.sort).print_stats(args.rows)
    print(out.getvalue())
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as tp:
        for _ in range(args.steps):
            engine.step(ready(engine, seqs))
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

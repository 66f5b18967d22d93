"""Where a thinker decode step's time goes: cProfile of the host side and torch.profiler's view of both
sides, for one batch size and prompt length, on the config's engine (overrides as in bench.stages).

    python -m bench.profile_step --config configs/bench-1xh200.yaml --set thinker.engine=native --batch 64
"""

import argparse
import cProfile
import io
import pstats

import torch

from bench.stages import THINKER_SAMPLING
from services.llm.sampling import SamplingParams
from services.runtime.config import load_config


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rows", type=int, default=30)
    args = p.parse_args(argv)
    from services.thinker.reference import ThinkerSeq
    from services.thinker.server import make_engine

    cfg = load_config(args.config, args.set)
    device = cfg.thinker.replicas[0].device
    engine = make_engine(cfg, device)
    gen = torch.Generator().manual_seed(0)
    seqs = [ThinkerSeq(f"p{i}", torch.randint(0, engine.vocab, (args.prompt_len,), generator=gen),
                       SamplingParams(max_tokens=3 * args.steps + 4, seed=i + 1, **THINKER_SAMPLING)) for i in range(args.batch)]
    for s in seqs:
        engine.add(s)
    while any(not s.generated for s in seqs):
        engine.step(seqs)
    for _ in range(args.steps):  # warm
        engine.step(seqs)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step(seqs)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.rows)
    print(out.getvalue())
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as tp:
        for _ in range(args.steps):
            engine.step(seqs)
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if torch.cuda.is_available():
        print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()

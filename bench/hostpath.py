"""The thinker's captured decode step, host side only, on the CPU: a step's host time by phase, without a GPU.

    python -m bench.hostpath [--rows 32] [--steps 2000] [--prompt-len 64] [--staggered] [--out FILE.json]

The native thinker runs on the tiny model with the stand-ins of tests/test_decode_host.py (flashinfer's wrapper in
PyTorch, each decode "graph" its body run eagerly), the defaults of a GPU config (overlapped steps, graphs that load
their inputs and store their draws, direct plans kept where they would not change), and each replay after a size's
first hands back that first run's outputs: what is timed is the host's work around the graph, the part of a step
that issue 5's host time counts. Rows start at `--prompt-len` prompt tokens (64), or at that + their index
(`--staggered`: a page comes due most steps); long prompts come out of chunked prefill staggered too. The steps run
in rounds; each phase's least time a step over the rounds is reported, the least a machine shared with other work
gives (bench/results/README.md, "Session 25" and "Session 26", has figures).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


class _Patch:
    """pytest's monkeypatch as the stand-ins use it, for good: this command's process only (a test passes its own)."""

    def setattr(self, owner, name, value):
        setattr(owner, name, value)

    def setitem(self, mapping, key, value):
        mapping[key] = value


def main(argv=None, patch=None) -> dict:
    """`patch`: what sets the stand-ins in place (pytest's monkeypatch, undone after a test; by default for good)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--staggered", action="store_true")
    p.add_argument("--model", default=str(ROOT / ".cache" / "tiny-qwen3-omni"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    import test_decode_host as stand_ins

    from services.llm.sampling import SamplingParams
    from services.thinker.reference import ThinkerSeq

    patch = patch or _Patch()
    patch.setattr(stand_ins, "STAND_IN_SMS", 132)  # an H200's: plans are kept as there, not replanned for want of room
    pages_a_row = -(-(args.prompt_len + args.rows + args.steps + 80) // 16)  # its prompt, steps and margin
    engine = stand_ins.captured(args.model, patch, 64, device="cpu", overlap=True, decode_direct_plan=True,
                                decode_keep_plans=True, decode_mapped_io=True, block_size=16,
                                kv_blocks=max(8192, args.rows * pages_a_row), max_batched_tokens=8192)
    graphs, first = engine.decode.graphs, {}
    replay = type(graphs).replay

    def host_only(b: int):
        if b not in first:
            first[b] = replay(graphs, b)
        else:  # what the graph does to the host's state: its replay counted, its staging turn taken
            graphs.replays += 1
            engine.decode.inputs[b].staging.turned()
        return first[b]

    graphs.replay = host_only
    gen = torch.Generator().manual_seed(0)
    seqs = [ThinkerSeq(f"r{i}", torch.randint(0, engine.vocab, (args.prompt_len + (i if args.staggered else 0),),
                                                  generator=gen),
                       SamplingParams(max_tokens=args.steps + 64, ignore_eos=True)) for i in range(args.rows)]
    for s in seqs:
        engine.add(s)
    while min(len(s.generated) for s in seqs) < 8:  # prompts, then the first decode steps of every size
        engine.step(seqs)
    per_round, best, host_best = max(args.steps // args.rounds, 1), {}, float("inf")
    for _ in range(args.rounds):
        before, host = dict(engine.laps.seconds), 0.0
        t0 = time.perf_counter()
        for _ in range(per_round):
            engine.step(seqs)
            host += engine.last_host_s
        wall = time.perf_counter() - t0
        host_best = min(host_best, 1000 * host / per_round)
        for k, v in engine.laps.seconds.items():
            if k != "wait":
                best[k] = min(best.get(k, float("inf")), 1000 * (v - before.get(k, 0.0)) / per_round)
    out = {"rows": args.rows, "prompt_len": args.prompt_len, "staggered": args.staggered,
           "steps": per_round * args.rounds,
           "host_ms_per_step": round(host_best, 4), "host_split_ms": {k: round(v, 4) for k, v in best.items()},
           "last_round_wall_ms_per_step": round(1000 * wall / per_round, 4)}
    print(" ".join(f"{k}={v}" for k, v in out.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

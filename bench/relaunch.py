"""Why the thinker's decode graph launches slowly in every decode cell but a process's first.

    python -m bench.relaunch --config configs/bench-1xh200.yaml [--set section.key=value ...] \
        [--plan idle,cell,steady,cell,profile,idle,cell,steady,recapture,idle,cell,steady] [--batch 32] [--out FILE.json]

In each of session 24's six processes of bench.stages cells (bench/results/README.md, "Session 24"), the first
decode cell launched its graph in 0.03-0.13 ms a step and every later one in 0.33-0.85 ms, whatever its size, with
the graphs drawing from a generator or not, on CPUs pinned away from the GPU's interrupts (there were none) and with
no other thread busy. This runs the native thinker's decode at one batch through a plan of actions, one process:
- cell: `batch` new requests of `--prompt-len` random tokens prefilled, then `--steps` decode steps timed as
  bench.stages times them (the engine's own host and launch seconds a step), the requests freed after;
- steady: the decode graph of that batch relaunched `--steps` times with nothing else on the host, each launch
  behind the one before (still running), waiting for the launch before that: the overlapped loop's launches with
  none of its host work (an even number, so the graph's staging turns come back where they were);
- idle: the same graph launched from an idle device each time (the launch's own cost in the process's state);
- profile: two replays under torch.profiler, as bench.stages timed each cell's device time until 0921460 (the
  likeliest cause: CUPTI stays attached once the profiler has run);
- recapture: the decode graphs captured anew (the old ones dropped).
Cells and launches slower after `profile` than before it put the cost in the profiler's leftovers; a steady loop as
slow as the cell before it, in the driver's state for that graph or the process; one as fast as the first cell's
launches, in what the engine does between its launches; a recaptured graph launching fast again, in the graph
executable itself.
"""

import argparse
import gc
import statistics
import sys
import time

import torch

from bench.graph_launch import launch_us
from bench.hostprof import cpu_probe
from bench.records import percentile
from bench.results import machine, new_result, write
from bench.stages import device_ms
from services.llm.graphs import CapturedGraphs
from services.llm.sampling import SamplingParams
from services.runtime.config import load_config
from services.thinker.reference import ThinkerSeq
from services.thinker.server import make_engine


def cell(engine, batch: int, prompt_len: int, steps: int, gen: torch.Generator) -> dict:
    seqs = [ThinkerSeq(f"relaunch-{i}", torch.randint(0, engine.vocab, (prompt_len,), generator=gen),
                       SamplingParams(max_tokens=steps + 4, seed=i + 1, temperature=0.7, top_p=0.9, top_k=20))
            for i in range(batch)]
    for s in seqs:
        engine.add(s)
    while any(not s.generated for s in seqs):
        engine.step(seqs)
    hosts, launches = [], []
    for _ in range(steps):
        engine.step(seqs)
        hosts.append(engine.last_host_s)
        launches.append(engine.last_launch_s)
    for s in seqs:
        engine.free(s)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return {"host_ms": 1000 * statistics.median(hosts), "launch_ms": 1000 * statistics.median(launches),
            "launch_ms_p90": 1000 * percentile(launches, 90)}


def steady(engine, batch: int, steps: int) -> dict:
    """The decode graph of `batch` rows relaunched behind itself (its copies in turn: decode_graph_copies), each
    launch after waiting for the one two back."""
    graphs = engine.decode.graphs
    b = graphs.size_for(batch)
    stream = torch.cuda.current_stream(engine.device)
    events = [torch.cuda.Event(), torch.cuda.Event()]
    times = []
    for i in range(steps + steps % 2):
        t0 = time.perf_counter()
        graphs.replay(b)
        times.append(time.perf_counter() - t0)
        events[i % 2].record(stream)
        events[(i + 1) % 2].synchronize()  # the launch before this one (the overlapped loop's wait)
    torch.cuda.synchronize(engine.device)
    engine.decode.forget()
    return {"launch_ms": 1000 * statistics.median(times), "launch_ms_p90": 1000 * percentile(times, 90)}


class _Turns:
    """The decode graphs of one size as bench.graph_launch times a graph: replay() takes its copies in turn."""

    def __init__(self, graphs, b: int):
        self.graphs, self.b = graphs, b

    def replay(self) -> None:
        self.graphs.replay(self.b)


def idle(engine, batch: int, steps: int) -> dict:
    """The decode graph of `batch` rows launched from an idle device each time (its copies in turn): what a launch
    costs the host in the process's present state with nothing queued before it (bench.graph_launch.launch_us)."""
    graphs = engine.decode.graphs
    us = launch_us(_Turns(graphs, graphs.size_for(batch)), steps + steps % 2)  # even: staging turns come back
    engine.decode.forget()
    return {"launch_ms": us / 1000}


def profile(engine, batch: int) -> dict:
    """Two replays of the decode graph of `batch` rows under torch.profiler (bench.stages.device_ms), as bench.stages
    measured each cell's device time until 0921460: whether the launches after it are slower (CUPTI left attached)."""
    turns = _Turns(engine.decode.graphs, engine.decode.graphs.size_for(batch))
    torch.cuda.synchronize(engine.device)
    ms = device_ms(lambda: [turns.replay() for _ in range(2)], engine.device)  # even: staging turns come back
    engine.decode.forget()
    return {"kernels_ms": None if ms is None else ms / 2}


def recapture(engine) -> dict:
    decode = engine.decode
    t0 = time.perf_counter()
    copies = len(next(iter(decode.graphs.copies.values())))
    decode.graphs = None  # the old executables and their pool dropped first
    gc.collect()
    decode.graphs = CapturedGraphs(sorted(decode.inputs), decode.body, engine.device, copies)
    decode.forget()
    return {"seconds": time.perf_counter() - t0}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--plan", default="idle,cell,steady,cell,profile,idle,cell,steady,recapture,idle,cell,steady")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--out")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    plan = args.plan.split(",")
    engine = make_engine(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    if getattr(engine, "decode", None) is None and set(plan) - {"cell"}:
        raise SystemExit("steady, idle, profile and recapture need decode graphs: the native thinker with flashinfer and capturable "
                         "experts, on a GPU")
    gen = torch.Generator().manual_seed(0)
    actions = {"cell": lambda: cell(engine, args.batch, args.prompt_len, args.steps, gen),
               "steady": lambda: steady(engine, args.batch, args.steps),
               "idle": lambda: idle(engine, args.batch, min(args.steps, 64)), "profile": lambda: profile(engine, args.batch),
               "recapture": lambda: recapture(engine)}
    rows = []
    for name in plan:
        if name not in actions:
            raise SystemExit(f"unknown action {name!r}: {sorted(actions)}")
        row = {"action": name, "batch": args.batch, "cpu_probe_us": cpu_probe(), **actions[name]()}
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
    if args.out:
        command = "python -m bench.relaunch " + " ".join(sys.argv[1:] if argv is None else argv)
        result = new_result("relaunch", {}, {}, {"command": command})
        result["machine"], result["cells"] = machine(), rows
        write(result, args.out)


if __name__ == "__main__":
    main()

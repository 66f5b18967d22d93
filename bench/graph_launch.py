"""What launching a captured graph costs the host: straight chains of small kernels against the same kernels
forked onto a second stream and joined back every few kernels, then a stage's own graphs (the thinker's decode
step; the talker's frame step, code predictor and code2wav), timed the same way and described from their DOT
(nodes by type, edges, whether they form one straight line). CUDA 12.6 launches a straight line of kernel nodes
in about constant time. Ours took 0.97 ms of host time a launch for the thinker's decode step at 32 requests
(bench/results/profile-1xh200-b32-decode-plain-f29cb53.txt: most of issue 5's 1 ms for a step's host work) and
1.72 ms a launch for the talker's, two a frame step (profile-1xh200-talker-b32-f29cb53.txt, steps overlapped: some
of that may be waiting for room behind the step before); its frame step took 12.4 ms, its kernels 6.3. So each
graph is also launched right behind itself, still running (as an overlapped step is), and behind another
executable: does relaunching a running executable make the host wait for it?

    python -m bench.graph_launch --config configs/bench-1xh200.yaml --stages thinker,talker --set thinker.engine=native \
        --set thinker.moe=triton --set thinker.cuda_graph_max_batch=64 --set thinker.compile=true ... --out OUT.json
"""

import argparse
import gc
import importlib
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from bench.results import machine, new_result, write

# Statements of cudaGraphDebugDotPrint's DOT: edges `"g_node_1" -> "g_node_2" [...];` and nodes `"g_node_1" [...];`,
# whose attributes (a label over several lines in its verbose form) name the node's type.
EDGE = re.compile(r'"?(\w+_node_\d+)"?\s*->\s*"?(\w+_node_\d+)"?\s*(?:\[[^\]]*\])?\s*;?', re.S)
NODE = re.compile(r'"?(\w+_node_\d+)"?\s*\[(.*?)\]\s*;?', re.S)
TYPES = ("KERNEL", "MEMSET", "MEMCPY", "EVENT_RECORD", "WAIT_EVENT", "HOST", "EMPTY", "MEM_ALLOC", "MEM_FREE",
         "CONDITIONAL", "GRAPH")


def dot_summary(text: str) -> dict:
    """A graph's nodes by type, its edges, and whether it is one straight line (each node one edge in and one
    out, but the ends), from cudaGraphDebugDotPrint's DOT."""
    ins, outs = Counter(), Counter()
    edges = EDGE.findall(text)
    for a, b in edges:
        outs[a] += 1
        ins[b] += 1
    nodes = NODE.findall(EDGE.sub("", text))
    kinds = {name: next((t for t in TYPES if re.search(rf"\b{t}\b", attrs)), "OTHER") for name, attrs in nodes}
    # What each copy and fill is: its label with addresses and IDs taken out, counted (which ones repeat a layer)
    copies = Counter(re.sub(r"\s+", " ", re.sub(r"0x[0-9a-fA-F]+|\bID \| \d+ \| \d+", "", attrs)).strip()[:300]
                     for name, attrs in nodes if kinds[name] in ("MEMCPY", "MEMSET"))
    edges = len(edges)
    n = len(kinds)
    straight = n > 0 and edges == n - 1 and max(ins.values(), default=0) <= 1 and max(outs.values(), default=0) <= 1
    return {"nodes": n, "edges": edges, "by_type": dict(Counter(kinds.values())), "straight_line": straight,
            "max_in": max(ins.values(), default=0), "max_out": max(outs.values(), default=0),
            **({"copies": dict(copies.most_common())} if copies else {})}


def launch_us(graph: "torch.cuda.CUDAGraph", reps: int) -> float:
    """The host's time in one replay of `graph`, median over `reps`, each from an idle device (nothing queued
    before it, so none of it is waiting for room in the launch queue)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def launch_behind_us(graph: "torch.cuda.CUDAGraph", before: "torch.cuda.CUDAGraph", reps: int) -> float:
    """The host's time in one replay of `graph` queued right behind a replay of `before`, still running on the
    device: `graph` itself (as a decode step is launched while the previous one runs, overlapped), or another
    graph. Median over `reps`, each from an idle device. If relaunching an executable that is still running made
    the host wait for it, `graph` behind itself takes about `before`'s device time and behind another its
    launch_us."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        before.replay()
        t0 = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def device_us(launch, reps: int) -> float:
    """The device's time per call of `launch` (a graph's replay, or several): events on the current stream around
    `reps` calls, after two untimed."""
    main = torch.cuda.current_stream()
    for _ in range(2):
        launch()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(main)
    for _ in range(reps):
        launch()
    end.record(main)
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def capture(body, debug_path: str | None = None) -> "torch.cuda.CUDAGraph":
    """`body` recorded as a graph on a side stream, after one run outside it (kernels compiled and chosen); with
    `debug_path`, its DOT written there."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=bool(debug_path))  # else capture_end drops the graph: nothing to dump
    if debug_path:
        graph.enable_debug_mode()
    with torch.cuda.graph(graph, stream=stream):
        body()
    if debug_path:
        graph.debug_dump(debug_path)
        graph.instantiate()
    return graph


def synthetic(kernels: int, fork_every: int, x: torch.Tensor, y: torch.Tensor, side: torch.cuda.Stream):
    """`kernels` small kernels in a row; with `fork_every`, every that many of them one more runs on `side`,
    forked from the main stream and joined back (a branch, as a second stream inside a step makes)."""
    def body():
        main = torch.cuda.current_stream()
        for i in range(kernels):
            x.add_(1)
            if fork_every and i % fork_every == fork_every - 1:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    y.add_(1)
                main.wait_stream(side)
    return body


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", help="also the graphs of the --stages engines, made from this config")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--kernels", default="100,800")
    p.add_argument("--stages", default="thinker", help="whose graphs to time with --config: thinker and/or talker")
    p.add_argument("--batches", default="1,32", help="the batch sizes whose graphs to time (the captured size each runs)")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    command = "python -m bench.graph_launch " + " ".join(sys.argv[1:] if argv is None else argv)
    result = new_result("graph_launch", {}, {}, {"command": command})
    result["machine"] = machine()
    dots = Path(tempfile.mkdtemp(prefix="graphs-"))
    x, y, side = torch.zeros(256, device="cuda"), torch.zeros(256, device="cuda"), torch.cuda.Stream()
    for n in (int(k) for k in args.kernels.split(",")):
        for fork in (0, 16):
            path = dots / f"synthetic-{n}-{fork}.dot"
            body = synthetic(n, fork, x, y, side)
            graph, twin = capture(body, str(path)), capture(body)  # twin: the same kernels, another executable
            cell = {"graph": f"{n} kernels" + (f", a fork every {fork}" if fork else ", straight"),
                    "launch_us": launch_us(graph, args.reps), "behind_itself_us": launch_behind_us(graph, graph, args.reps),
                    "behind_another_us": launch_behind_us(graph, twin, args.reps), "device_us": device_us(graph.replay, args.reps),
                    **dot_summary(path.read_text())}
            if not fork and (cell["nodes"] != n or not cell["straight_line"]):  # the DOT read wrongly: say so
                print(f"warning: a straight chain of {n} kernels read as {cell['nodes']} nodes, "
                      f"straight_line {cell['straight_line']}", flush=True)
            result["cells"].append(cell)
            write(result, args.out)
            print(cell, flush=True)
    if args.config:
        from services.runtime.config import load_config

        cfg = load_config(args.config, args.set)
        result["config"] = {"path": args.config, "set": args.set}
        for stage in args.stages.split(","):
            found = engine_graphs(stage, cfg, dots / stage)
            for name, captured in found:
                for b in sorted({captured.size_for(min(int(b), captured.max_batch)) for b in args.batches.split(",")}):
                    dot = dots / stage / f"graphs{captured.capture}-b{b}.dot"
                    graph = captured.graphs[b][0]
                    # Behind another executable: the next smaller size's graph (the same step for fewer rows).
                    other = max((s for s in captured.sizes if s < b), default=None)
                    cell = {"graph": f"{name}, batch {b}", "launch_us": launch_us(graph, args.reps),
                            "behind_itself_us": launch_behind_us(graph, graph, args.reps),
                            "behind_another_us": None if other is None else
                            launch_behind_us(graph, captured.graphs[other][0], args.reps),
                            "another": other, "device_us": device_us(graph.replay, args.reps), **dot_summary(dot.read_text())}
                    result["cells"].append(cell)
                    write(result, args.out)
                    print(cell, flush=True)
            del found, captured  # the engine with them: the next stage's gets the GPU's memory
            gc.collect()
            torch.cuda.empty_cache()


def engine_graphs(stage: str, cfg, folder: Path) -> list:
    """(name, CapturedGraphs) of a stage's engine made from `cfg`, each capture's DOT kept in `folder`: the
    thinker's decode graphs, or the talker's frame step, code predictor and code2wav (one set per chunk length)."""
    from services.llm import graphs

    if stage not in ("thinker", "talker"):
        raise SystemExit(f"--stages takes thinker and/or talker, not {stage!r}")
    make_engine = importlib.import_module(f"services.{stage}.server").make_engine
    folder.mkdir()
    graphs.DUMP_DIR = str(folder)
    try:
        engine = make_engine(cfg, getattr(cfg, stage).replicas[0].device)
    finally:
        graphs.DUMP_DIR = None
    if stage == "thinker":
        found = [("thinker decode", engine.decode.graphs if engine.decode is not None else None)]
    else:
        found = [("talker frame step", engine.decode.graphs if engine.decode is not None else None),
                 ("code predictor", engine.predictor.graphs)]
        found += [(f"code2wav of {frames} frames", c2w) for frames, (_, c2w) in sorted(engine.c2w_graphs.items())]
    found = [(name, g) for name, g in found if g is not None]
    if not found:
        raise SystemExit(f"the {stage} captured no graphs (cuda_graph_max_batch 0, or no GPU engine)")
    return found


if __name__ == "__main__":
    main()

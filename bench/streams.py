"""Would a stage's captured steps run side by side on two streams? A decode step at 32 requests is a chain of small
kernels (the thinker's some 900, the code predictor's 1,200 a frame), each too small to fill the GPU: the talker's
frame step spent 6.4 ms in kernels at 32 requests (bench/results/profile-1xh200-talker-b32-acc04a2.txt). If two
halves of a batch, each its own graph on its own stream, overlap on the device, a frame of 32 costs less than one
graph of 32; this measures that before an engine is built around it.

For each graph (the thinker's decode step, the code predictor's frame) and batch size: captured twice, each copy
its own memory pool, inputs filled with random ids and states; the device time of one replay, of two one after
the other, and of two at once on two streams. Timing only: both copies write the same caches, so what they
compute side by side is garbage. The thinker's copies attend to one key each (their plan is the engine's padding
plan), so its attention is cheaper than at 512 tokens.

    python -m bench.streams --config configs/bench-1xh200.yaml --set thinker.engine=native ... --set talker.engine=native \
        ... --batches 16,32 --out bench/results/streams-1xh200.json
"""

import argparse
import gc
import importlib
import sys

import torch

from bench.graph_launch import device_us
from bench.results import machine, new_result, write


def side_by_side(first, second, streams):
    """A launch of `first` and `second` (graphs) at once, each on its own stream, both after what the current stream
    queued before and before what it queues after."""
    def launch():
        main = torch.cuda.current_stream()
        for stream, graph in zip(streams, (first, second)):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                graph.replay()
        for stream in streams:
            main.wait_stream(stream)
    return launch


def bodies(stage: str, cfg) -> list:
    """A stage's engine built from `cfg` and its step bodies to capture, (name, body, device) each, the step's inputs
    filled with random values."""
    make_engine = importlib.import_module(f"services.{stage}.server").make_engine
    if stage == "thinker":  # its inputs filled on the device below: graphs that load them from the host would not see them
        cfg.thinker.decode_mapped_io = False
    engine = make_engine(cfg, getattr(cfg, stage).replicas[0].device)
    gen = torch.Generator(device=engine.device).manual_seed(0)
    if stage == "thinker":
        if engine.decode is None:
            raise SystemExit("the thinker captured no decode graphs (cuda_graph_max_batch 0, or no GPU engine)")
        for inputs in engine.decode.inputs.values():  # each batch size's ids and positions
            ids, pos = inputs.ints[0], inputs.ints[1]
            ids.copy_(torch.randint(0, engine.vocab, ids.shape, device=engine.device, generator=gen))
            pos.copy_(torch.arange(len(pos), device=engine.device) + 512)
        return engine, [("thinker decode", engine.decode.body, engine.device)]
    engine.predictor.hidden.normal_(generator=gen)
    engine.predictor.ints[0].random_(0, 2048, generator=gen)  # code 0 of every row
    return engine, [("code predictor frame", engine.predictor.body, engine.device)]


def main(argv=None) -> None:
    from services.runtime.config import load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--stages", default="thinker,talker")
    p.add_argument("--batches", default="8,16,32")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    result = new_result("streams", {"path": args.config, "set": args.set}, {},
                        {"command": "python -m bench.streams " + " ".join(sys.argv[1:] if argv is None else argv)})
    result["machine"] = machine()
    cfg = load_config(args.config, args.set)
    batches = [int(b) for b in args.batches.split(",")]
    for stage in args.stages.split(","):
        if stage not in ("thinker", "talker"):
            raise SystemExit(f"--stages takes thinker and/or talker, not {stage!r}")
        for cell in measure(stage, cfg, batches, args.reps):
            result["cells"].append(cell)
            write(result, args.out)
            print(cell, flush=True)
        gc.collect()  # the stage's engine, gone with measure()'s frame: the next one gets the GPU's memory
        torch.cuda.empty_cache()


def measure(stage: str, cfg, batches: list[int], reps: int):
    """The cells of one stage's graphs, one batch size at a time."""
    from services.llm.graphs import CapturedGraphs

    engine, found = bodies(stage, cfg)
    for name, body, device in found:
        streams = [torch.cuda.Stream(device) for _ in range(2)]
        for b in batches:
            one, two = CapturedGraphs([b], body, device), CapturedGraphs([b], body, device)  # a pool each
            g1, g2 = one.graphs[b][0], two.graphs[b][0]
            cell = {"stage": stage, "graph": name, "batch": b, "one_us": device_us(g1.replay, reps),
                    "two_in_turn_us": device_us(lambda: (g1.replay(), g2.replay()), reps),
                    "two_side_by_side_us": device_us(side_by_side(g1, g2, streams), reps)}
            cell["side_by_side_gain"] = cell["two_in_turn_us"] / cell["two_side_by_side_us"]
            yield cell


if __name__ == "__main__":
    main()

"""Steps as CUDA graphs: one graph per batch size of a ladder, all sharing one memory pool.

The engine owns the static inputs (token ids, positions, per-row sampling settings, ...) and a
`body(batch)` that reads them and returns the step's outputs; capture records body() once per size,
largest first. A step of n rows replays the smallest captured size >= n: the engine fills the first n
rows of its inputs (the rest is padding: inputs that touch nothing a real row reads, such as a scratch KV
block), prepares whatever the graph reads besides (an attention plan), replays, and reads the first n
rows of the outputs before the next replay overwrites them.
"""

import itertools
import time
from typing import Callable

import torch

# A folder for each captured graph's DOT (cudaGraphDebugDotPrint), named by capture and batch size: set by
# bench.graph_launch before an engine is made, to see what its graphs are made of. None: nothing kept.
DUMP_DIR: str | None = None
_captures = itertools.count()


def ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, then every 32: padding wastes at most a few rows where steps are cheap."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch]
    sizes += list(range(8, min(max_batch, 64) + 1, 8)) + list(range(96, max_batch + 1, 32))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class CapturedGraphs:
    @torch.no_grad()  # a recorded step never builds an autograd graph (nor a compiled variant that would)
    def __init__(self, sizes: list[int], body: Callable[[int], tuple], device: torch.device, copies: int = 1):
        # `copies`: each size recorded that many times, replayed in turn, so a launch never relaunches the executable
        # of the last `copies - 1` launches. One launch behind a running replay of itself waited no longer than from
        # an idle device, and two copies gave the same tok/s (bench/results/graph-launch-1xh200-thinker-eecd411.json,
        # thinker-1xh200-*-copies-*-eecd411.json); but the thinker's decode graph relaunched in a steady loop took
        # 0.24 ms a launch in one run (relaunch-1xh200-bf16-b32-partial-494db8d.txt). Outputs are each copy's own.
        if copies < 1:
            raise ValueError(f"copies must be at least 1, not {copies}")
        self.sizes = sorted(sizes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}  # size -> (graph, outputs): the first copy
        self.copies: dict[int, list[tuple[torch.cuda.CUDAGraph, tuple]]] = {}  # size -> every copy, in turn
        self._turn: dict[int, int] = {}
        self.replays = 0
        self.launch_s = 0.0  # the host's time in replay() so far: launching, and any wait the driver makes it do
        pool = None
        stream = torch.cuda.Stream(device)
        self.capture = capture = next(_captures)  # which capture of this process (the DOTs' names)
        for b in sorted(sizes, reverse=True):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the graph: kernels chosen, workspaces allocated
                    body(b)
            torch.cuda.current_stream(device).wait_stream(stream)
            for c in range(copies):
                graph = torch.cuda.CUDAGraph(keep_graph=DUMP_DIR is not None and c == 0)  # kept to be dumped
                if DUMP_DIR is not None and c == 0:
                    graph.enable_debug_mode()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    outputs = body(b)
                if DUMP_DIR is not None and c == 0:
                    graph.debug_dump(f"{DUMP_DIR}/graphs{capture}-b{b}.dot")
                    graph.instantiate()
                pool = graph.pool()
                self.copies.setdefault(b, []).append((graph, outputs))
            self.graphs[b], self._turn[b] = self.copies[b][0], 0
        torch.cuda.synchronize(device)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def replay(self, b: int) -> tuple:
        """Runs the graph of size `b` (inputs filled, plans made), the next of its copies; its outputs, valid until
        that copy's next replay (at least until the next replay)."""
        copies = self.copies[b]
        turn = self._turn[b]
        graph, outputs = copies[turn]
        self._turn[b] = (turn + 1) % len(copies)
        t0 = time.perf_counter()
        graph.replay()
        self.launch_s += time.perf_counter() - t0
        self.replays += 1
        return outputs

"""CUDA graphs: each recorded once from a body over static inputs, replayed by key, all of a runner in one pool.

A body reads buffers whose addresses never change (filled by the caller before each replay) and returns its
outputs; a replay returns those same tensors, valid until that graph's next replay. A batch of n rows replays
the graph of the smallest size >= n of a ladder, its padding rows touching only what no real row reads."""

from typing import Callable

import torch


def ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, then every 32: padding wastes at most a few rows where steps are cheap."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch]
    sizes += list(range(8, min(max_batch, 64) + 1, 8)) + list(range(96, max_batch + 1, 32))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def token_ladder(max_tokens: int) -> list[int]:
    """16, 32, 48, 64, then 96, 128, 192, 256, ... and `max_tokens`: at most half a step is padding."""
    sizes, b = [], 16
    while b < max_tokens:
        sizes.append(b)
        b = b + 16 if b < 64 else (b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3)
    return sizes + [max_tokens]


class Graphs:
    """Graphs by key. `while_serving`: other threads use the GPU meanwhile, which a global-mode capture refuses."""

    def __init__(self, device: torch.device, while_serving: bool = False):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.mode = "thread_local" if while_serving else "global"
        self.pool = None
        self.graphs: dict = {}
        self.replays = 0

    def __contains__(self, key) -> bool:
        return key in self.graphs

    @torch.no_grad()
    def capture(self, key, body: Callable[[], tuple]) -> None:
        """Records `body` as `key`'s graph after two warm-up runs (kernels chosen, workspaces allocated)."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                body()
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode=self.mode):
            outputs = body()
        self.pool = graph.pool()
        self.graphs[key] = graph, outputs

    def replay(self, key):
        graph, outputs = self.graphs[key]
        graph.replay()
        self.replays += 1
        return outputs


class Ladder:
    """`body(b)` recorded for every batch size b of `sizes`, largest first (the pool then fits every smaller one)."""

    def __init__(self, sizes: list[int], body: Callable[[int], tuple], device: torch.device):
        self.sizes = sorted(sizes)
        self.graphs = Graphs(device)
        for b in reversed(self.sizes):
            self.graphs.capture(b, lambda b=b: body(b))
        torch.cuda.synchronize(device)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @property
    def replays(self) -> int:
        return self.graphs.replays

    def size_for(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def replay(self, b: int):
        return self.graphs.replay(b)

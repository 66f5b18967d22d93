"""Decode steps as CUDA graphs: one graph per batch size of a ladder, all sharing one memory pool.

The engine owns the static inputs (token ids, positions, ...) and a `body(batch, attention)` that reads
them and returns the step's outputs; capture records body() once per size, largest first. A step of n
sequences replays the smallest captured size >= n: the engine fills the first n rows of its inputs, the
attention is planned for the n real sequences (the rest is padding that touches only a scratch block),
and the outputs' first n rows are the step's.
"""

from typing import Callable

import torch

from services.llm.attention import SeqSlice
from services.llm.flashinfer_attention import DecodeAttention


def ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, then every 32: padding wastes at most a few rows where steps are cheap."""
    sizes = [b for b in (1, 2, 4) if b <= max_batch]
    sizes += list(range(8, min(max_batch, 64) + 1, 8)) + list(range(96, max_batch + 1, 32))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, sizes: list[int], make_attention: Callable[[int], DecodeAttention],
                 body: Callable[[int, DecodeAttention], tuple[torch.Tensor, ...]], device: torch.device):
        self.sizes = sorted(sizes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, DecodeAttention, tuple]] = {}
        pool = None
        stream = torch.cuda.Stream(device)
        for b in sorted(sizes, reverse=True):
            attention = make_attention(b).plan([])  # all padding: shapes are what capture needs
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the graph: kernels chosen, workspaces allocated
                    body(b, attention)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs = body(b, attention)
            pool = graph.pool()
            self.graphs[b] = (graph, attention, outputs)
        torch.cuda.synchronize(device)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def size_for(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def replay(self, slices: list[SeqSlice]) -> tuple[torch.Tensor, ...]:
        """Runs the graph for len(slices) sequences (inputs already filled); outputs of the padded size."""
        graph, attention, outputs = self.graphs[self.size_for(len(slices))]
        attention.plan(slices)
        graph.replay()
        return outputs

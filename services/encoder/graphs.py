"""The vision tower replayed from CUDA graphs (encoder.graphs), one per list of grids it has met often enough.

Eager, a call of the vision tower launches its kernels one by one, some twenty a layer for 27 layers (one 512x512
image took 28.7 ms to encode at concurrency 1 in bench/results/2xh200-mesh-default-acc04a2.json; how much of that
is launching is what encoder.graphs' A/B measures). With its grid-derived inputs precomputed (services.encoder.plans) a call reads
nothing back from the device, so it can be captured: the pixels go into a static buffer, the graph replays, and
the outputs are copied out before the next replay of that graph overwrites them. A graph is captured for a list of
grids once it has been seen `after` times (or at start, for the warm-up's), at most `limit` of them, all in one
memory pool; other lists run eagerly, with their plan.
"""

from collections import Counter

import torch

from services.encoder.attention import forget_layout
from services.encoder.plans import Grids, VisionPlans


class VisionGraphs:
    def __init__(self, tower: torch.nn.Module, plans: VisionPlans, device: torch.device, limit: int = 16, after: int = 2):
        self.tower, self.plans, self.device = tower, plans, torch.device(device)
        self.limit, self.after = limit, after
        self.graphs: dict[Grids, tuple] = {}  # grids -> (pixel buffer, graph, pooled, deepstack, plan)
        self.seen: Counter[Grids] = Counter()
        self.pool = None
        self.replays = 0

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor, grids: Grids) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tower's merged embeddings and DeepStack features for `pixels` (normalised patches of `grids`):
        replayed where a graph is captured for these grids (captured now if they have been seen often enough),
        else run eagerly."""
        entry = self.graphs.get(grids)
        if entry is None:
            if len(self.seen) >= 4096:  # a server meeting ever new lists of sizes: counts start again, bounded
                self.seen.clear()
            self.seen[grids] += 1
            if self.seen[grids] >= self.after and len(self.graphs) < self.limit:
                entry = self.capture(pixels, grids)
        if entry is None:
            out = self.tower(pixels, **self.plans(grids))
            return out.pooler_output, list(out.deepstack_features)
        buffer, graph, pooled, deepstack, _ = entry
        buffer.copy_(pixels)
        graph.replay()
        self.replays += 1
        return pooled.clone(), [d.clone() for d in deepstack]  # the next replay of this graph overwrites them

    @torch.no_grad()
    def capture(self, pixels: torch.Tensor, grids: Grids) -> tuple:
        """Records the tower over a static copy of `pixels` for `grids` (after two runs outside the graph: kernels
        chosen, workspaces allocated); kept with its plan, whose tensors the graph reads."""
        plan = self.plans(grids)
        buffer = pixels.clone()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.tower(buffer, **plan)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        forget_layout()  # unequal items' layout made inside the graph, not the warm-up's kept one
        # Captured while serving: the server's other threads keep using the GPU (reading requests' pixels onto it),
        # which a capture in the default ("global") mode would refuse; their work is on other streams, not captured.
        with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
            out = self.tower(buffer, **plan)
        forget_layout()  # nor read outside it
        self.pool = graph.pool()
        entry = self.graphs[grids] = (buffer, graph, out.pooler_output, list(out.deepstack_features), plan)
        return entry

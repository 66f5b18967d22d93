"""The vision tower replayed from CUDA graphs, one per list of grids it has met often enough.

Eager, a call of the vision tower launches some twenty kernels a layer for 27 layers. With its grid-derived inputs
precomputed (services.encoder.plans) a call reads nothing back from the device, so it can be captured: the pixels
go into a static buffer, the graph replays, and the outputs are copied out before the next replay of that graph
overwrites them. A list of grids is captured once it has been seen `after` times (or at start, for the warm-up's),
at most `limit` of them; other lists run eagerly, with their plan.
"""

from collections import Counter

import torch

from services.encoder.attention import forget_layout
from services.encoder.plans import Grids, VisionPlans
from services.llm.graphs import Graphs


class VisionGraphs:
    def __init__(self, tower: torch.nn.Module, plans: VisionPlans, device: torch.device, limit: int = 16, after: int = 2):
        self.tower, self.plans, self.device = tower, plans, torch.device(device)
        self.limit, self.after = limit, after
        self.graphs = Graphs(self.device, while_serving=True)  # the server's thread keeps copying pixels in
        self.buffers: dict[Grids, torch.Tensor] = {}
        self.seen: Counter[Grids] = Counter()

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor, grids: Grids) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tower's merged embeddings and DeepStack features for `pixels` (normalised patches of `grids`):
        replayed where a graph is captured for these grids (captured now if they have been seen often enough),
        else run eagerly."""
        if grids not in self.graphs:
            if len(self.seen) >= 4096:  # a server meeting ever new lists of sizes: counts start again, bounded
                self.seen.clear()
            self.seen[grids] += 1
            if self.seen[grids] < self.after or len(self.buffers) >= self.limit:
                out = self.tower(pixels, **self.plans(grids))
                return out.pooler_output, list(out.deepstack_features)
            self.capture(pixels, grids)
        self.buffers[grids].copy_(pixels)
        pooled, deepstack = self.graphs.replay(grids)
        return pooled.clone(), [d.clone() for d in deepstack]  # the next replay of this graph overwrites them

    def capture(self, pixels: torch.Tensor, grids: Grids) -> None:
        """Records the tower over a static copy of `pixels` for `grids`; its plan's tensors are what the graph reads."""
        plan, buffer = self.plans(grids), pixels.clone()
        self.buffers[grids] = buffer

        def body():
            forget_layout()  # unequal items' layout made by this run (inside the graph: its own), not a kept one
            out = self.tower(buffer, **plan)
            return out.pooler_output, list(out.deepstack_features)

        self.graphs.capture(grids, body)
        forget_layout()  # the graph's layout tensors are not read outside it

"""The vision tower replayed from CUDA graphs, one per list of grids met often enough.

Eagerly a call launches many kernels a layer. With its grid-derived inputs precomputed (plans.py) it reads nothing
back, so it can be captured; a list of grids is captured once seen `after` times, at most `limit` of them."""

from collections import Counter

import torch

from services.encoder.attention import forget_layout
from services.encoder.plans import Grids, VisionPlans
from services.llm.graphs import Graphs


class VisionGraphs:
    def __init__(self, tower: torch.nn.Module, plans: VisionPlans, device: torch.device, limit: int = 16, after: int = 2):
        self.tower, self.plans, self.device = tower, plans, torch.device(device)
        self.limit, self.after = limit, after
        self.graphs = Graphs(self.device, while_serving=True)  # the server's thread copies pixels meanwhile
        self.buffers: dict[Grids, torch.Tensor] = {}
        self.seen: Counter[Grids] = Counter()

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor, grids: Grids) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Merged embeddings and DeepStack features of `pixels`: replayed, captured now, or run eagerly."""
        if grids not in self.graphs:
            if len(self.seen) >= 4096:  # bounded against ever new lists of sizes
                self.seen.clear()
            self.seen[grids] += 1
            if self.seen[grids] < self.after or len(self.buffers) >= self.limit:
                out = self.tower(pixels, **self.plans(grids))
                return out.pooler_output, list(out.deepstack_features)
            self.capture(pixels, grids)
        self.buffers[grids].copy_(pixels)
        pooled, deepstack = self.graphs.replay(grids)
        return pooled.clone(), [d.clone() for d in deepstack]  # the next replay overwrites them

    def capture(self, pixels: torch.Tensor, grids: Grids) -> None:
        """Records the tower over a static copy of `pixels` for `grids`."""
        plan, buffer = self.plans(grids), pixels.clone()
        self.buffers[grids] = buffer

        def body():
            forget_layout()  # the graph makes its own layout
            out = self.tower(buffer, **plan)
            return out.pooler_output, list(out.deepstack_features)

        self.graphs.capture(grids, body)
        forget_layout()  # nor is it read outside

"""What the vision tower computes from its items' grids alone, made once per list of grids.

transformers' Qwen3-Omni vision tower derives from `grid_thw` the interpolated position-embedding taps, the rotary
position ids, the packed items' boundaries (cu_seqlens) and the longest item, each with host reads of device values
(`.tolist()`, a tensor-sized `arange`, `.max().item()`): a call waits for the device before it can queue its
layers. Its forward takes all of them precomputed, as keyword arguments (transformers.vision_utils): made here once
for each distinct list of grids on the tower's device, a call with them reads nothing back, and could be captured.
"""

from collections import OrderedDict

import torch
from transformers.utils.generic import get_max_seqlen
from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                       get_vision_position_ids)

Grids = tuple[tuple[int, int, int], ...]


class VisionPlans:
    """The vision tower's grid-derived inputs by list of grids (t, h, w), the `size` most recently used kept."""

    def __init__(self, tower: torch.nn.Module, device: torch.device, size: int = 64):
        self.tower, self.device, self.size = tower, torch.device(device), size
        self.plans: OrderedDict[Grids, dict] = OrderedDict()
        self.made = 0  # plans computed (a miss), for tests and curiosity

    def __call__(self, grids: Grids) -> dict:
        """The keyword arguments for `tower(pixels, **plan)`: grid_thw and everything the tower would derive from it."""
        plan = self.plans.get(grids)
        if plan is None:
            plan = self.plans[grids] = self._make(grids)
            self.made += 1
            if len(self.plans) > self.size:
                self.plans.popitem(last=False)
        self.plans.move_to_end(grids)
        return plan

    def _make(self, grids: Grids) -> dict:
        tower, config = self.tower, self.tower.config
        grid_thw = torch.tensor(grids, dtype=torch.long, device=self.device)
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners, spatial_merge_size=config.spatial_merge_size)
        cu_seqlens = get_vision_cu_seqlens(grid_thw)
        return {"grid_thw": grid_thw, "interp_indices": indices, "interp_weights": weights,
                "position_ids": get_vision_position_ids(grid_thw, tower.spatial_merge_size), "cu_seqlens": cu_seqlens,
                "max_seqlen": get_max_seqlen(cu_seqlens, config)}  # an int for varlen attention, else None

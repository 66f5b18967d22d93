"""What the vision tower computes from its items' grids alone, made once per list of grids.

The tower derives position taps, rotary ids, cu_seqlens and the longest item from `grid_thw` with host reads of
device values, so a call waits before it queues its layers. Precomputed here and passed as keyword arguments, a
call reads nothing back and can be captured."""

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
        self.made = 0  # misses

    def __call__(self, grids: Grids) -> dict:
        """The keyword arguments for `tower(pixels, **plan)`."""
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

"""Whether the disk can hold a checkpoint: checked before a save writes anything (and by whoever
wants to know before training), so a full disk fails the save with one clear line."""

import math

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from titan_exp.checkpoint.layout import check_free_space

# DCP writes each item with torch.save (about 1.3 KB of headers) and lists it in .metadata (a few
# hundred bytes); a non-tensor value (an lr, the LR schedule's state) is a small pickle.
_ITEM_OVERHEAD = 4096


def planned_bytes(plans: list[SavePlan]) -> int:
    """What a save of every rank's `plans` (DCP's global plan: replicated tensors once) will write."""
    total = 0
    for plan in plans:
        for item in plan.items:
            data = item.tensor_data  # None for a non-tensor value
            tensor = math.prod(data.chunk.sizes) * data.properties.dtype.itemsize if data else 0
            total += tensor + _ITEM_OVERHEAD
    return total


class SpaceCheckingPlanner(DefaultSavePlanner):
    """DCP's save planner, refusing a save the disk cannot hold before anything is written. The check
    runs on the coordinator over all ranks' plans: DCP hands its failure to every rank, so all stop
    together (a rank that went on would wait for the others in DCP's collectives)."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        delta, metadata = super().create_global_plan(all_plans)
        check_free_space(self.folder, planned_bytes(self.global_plan))
        return delta, metadata

"""Pipeline parallelism with torch.distributed.pipelining: each rank of the pp mesh dimension holds
one stage (or several "virtual" stages for the looped and V-shaped schedules; the cut is in
parallel/stages.py), and a schedule runs the microbatches through them.

Importing torch.distributed.pipelining takes about 0.5 s, so the trainer imports this module only
for jobs with pp > 1."""

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.distributed.tensor import DTensor

from titan_exp.parallel.config import SINGLE_STAGE_SCHEDULES, ParallelismConfig
from titan_exp.parallel.stages import StagePlan


class RankStages(Protocol):
    """This rank's stages (train/model_parts.py's ModelParts): the modules, their places in the plan."""

    parts: list[nn.Module]
    stage_ids: list[int]
    stage_plan: StagePlan


class Pipeline:
    """The stages of this rank and the schedule that drives them."""

    def __init__(
        self,
        model: "RankStages",
        cfg: ParallelismConfig,
        pp_group,
        device: torch.device,
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ):
        """`loss_fn(outputs, labels)`: the mean loss of one microbatch, run on the last stage."""
        plan, stage_ids = model.stage_plan, model.stage_ids
        stages = [
            PipelineStage(part, stage, plan.num_stages, device, group=pp_group)
            for part, stage in zip(model.parts, stage_ids)
        ]
        schedule_class = get_schedule_class(cfg.pipeline_parallel_schedule)
        # The loss is a mean per microbatch; the schedule scales gradients by 1/n_microbatches, so the
        # step's gradient is the mean over the whole local batch, as without pipelining.
        if cfg.pipeline_parallel_schedule in SINGLE_STAGE_SCHEDULES:
            self.schedule = schedule_class(stages[0], n_microbatches, loss_fn=loss_fn)
        else:
            self.schedule = schedule_class(stages, n_microbatches, loss_fn=loss_fn)
        self.has_first = 0 in stage_ids
        self.has_last = plan.num_stages - 1 in stage_ids

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, forward_only: bool = False) -> torch.Tensor:
        """Forward and backward of one local batch (`forward_only`: forward alone, the schedule's
        eval); the mean loss on the last stage's rank, else 0."""
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels, "losses": losses} if self.has_last else {}
        run = self.schedule.eval if forward_only else self.schedule.step
        if self.has_first:
            run(inputs, **kwargs)
        else:
            run(**kwargs)
        if not self.has_last:
            return torch.zeros((), device=inputs.device)
        # Under tensor parallelism (loss parallel) each loss is a replicated DTensor.
        return torch.stack([_local(loss.detach()) for loss in losses]).mean()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t

"""Pipeline parallelism with torch.distributed.pipelining: each rank of the pp mesh dimension holds
one stage (or several "virtual" stages for the looped and V-shaped schedules; the cut is in
parallel/stages.py), and a schedule runs the microbatches through them.

Importing torch.distributed.pipelining takes about 0.5 s, so the trainer imports this module only
for jobs with pp > 1."""

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _ComputationType, get_schedule_class
from torch.distributed.tensor import DTensor

from titan_exp.parallel.config import SINGLE_STAGE_SCHEDULES, ParallelismConfig
from titan_exp.parallel.stages import StagePlan

# What a forward pass runs of a schedule's actions (FSDP's unshard/reshard of a stage included).
FORWARD_ACTIONS = (
    _ComputationType.FORWARD,
    _ComputationType.SEND_F,
    _ComputationType.RECV_F,
    _ComputationType.UNSHARD,
    _ComputationType.RESHARD,
)


class RankStages(Protocol):
    """This rank's stages (train/model_parts.py's ModelParts): the modules, their places in the plan."""

    parts: list[nn.Module]
    stage_ids: list[int]
    stage_plan: StagePlan


class _Stage(PipelineStage):
    """torch's stage, its first-step shape inference (a forward of its own, on the first microbatch
    or on uninitialised tensors) run inside `inference_context`: a MoE model leaves it out of the
    experts' load, which is then the step's microbatches' alone, as in every other layout."""

    def __init__(self, *args, inference_context: Callable[[], contextlib.AbstractContextManager], **kwargs):
        super().__init__(*args, **kwargs)
        self.inference_context = inference_context

    def _forward_metadata_inference(self, *args, **kwargs):  # torch 2.13's (private) hook
        with self.inference_context():
            return super()._forward_metadata_inference(*args, **kwargs)


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
        inference_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        """`loss_fn(outputs, labels)`: the mean loss of one microbatch, run on the last stage;
        `inference_context`: what the stages' shape inference runs in."""
        plan, stage_ids = model.stage_plan, model.stage_ids
        stages = [
            _Stage(part, stage, plan.num_stages, device, group=pp_group, inference_context=inference_context)
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

    def step(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        documents: torch.Tensor | None = None,
        forward_only: bool = False,
    ) -> torch.Tensor:
        """Forward and backward of one local batch (`forward_only`: forward alone, the schedule's
        eval); the mean loss on the last stage's rank, else 0. `documents`: each token's document
        (block_causal), split into microbatches by the schedule and given to every stage."""
        losses: list[torch.Tensor] = []
        kwargs: dict = {"target": labels, "losses": losses} if self.has_last else {}
        if documents is not None:
            kwargs["documents"] = documents
        if not forward_only:
            # Only the losses are read: returning the outputs (torch's default; torchtitan's until
            # its #1922 of 2025-10-22) would keep every microbatch's logits on the last stage.
            kwargs["return_outputs"] = False
        run = self.schedule.eval if forward_only else self.schedule.step
        with _forward_actions_only(self.schedule) if forward_only else contextlib.nullcontext():
            if self.has_first:
                run(inputs, **kwargs)
            else:
                run(**kwargs)
        if not self.has_last:
            return torch.zeros((), device=inputs.device)
        # Under tensor parallelism (loss parallel) each loss is a replicated DTensor.
        return torch.stack([_local(loss.detach()) for loss in losses]).mean()


@contextlib.contextmanager
def _forward_actions_only(schedule) -> Iterator[None]:
    """A schedule's forward pass alone: torch's eval skips full backward steps but still runs the
    split ones of the zero-bubble schedules (ZBVZeroBubble: "can't steal_bwd_input"), so those
    run a copy of their action list without the backward actions and their sends. Each rank's
    forwards keep their order, so the pipeline still drains."""
    if not hasattr(schedule, "pipeline_order_with_comms"):  # single-stage and the plain looped ones
        yield
        return
    order = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {rank: _forward_actions(actions) for rank, actions in order.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order


def _forward_actions(actions: list) -> list:
    kept = []
    for action in actions:
        if action.computation_type == _ComputationType.OVERLAP_F_B:
            kept += _forward_actions(action.sub_actions)
        elif action.computation_type in FORWARD_ACTIONS:
            kept.append(action)
    return kept


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t

"""One training step on a rank, the same for training, the dry run (train/dry_run.py) and the
planner's measurement (plan/measure.py): forward and backward over the step's microbatches, then
the update (partial-sum gradients summed, the global norm clipped, the optimizers and schedules
stepped, float8's scales and the experts' balance kept up); and the step's loss as every rank sees it."""

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titan_exp.config.job import ResolvedJob
from titan_exp.data.loader import BatchLoader
from titan_exp.models.common.moe.balance import ExpertBalance
from titan_exp.models.common.moe.layer import MoE, uncounted
from titan_exp.models.common.rotary import document_ids
from titan_exp.optim.grad_clip import clip_grad_norm_, reduce_partial_gradients
from titan_exp.optim.optimizer import Optimizers
from titan_exp.parallel.context import build_context_parallel
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.quantize.float8 import after_optimizer_step
from titan_exp.train.loss import compiled_loss, cross_entropy_loss
from titan_exp.train.model_parts import ModelParts

if TYPE_CHECKING:  # imported for pp > 1 only (build_pipeline)
    from titan_exp.parallel.pipeline import Pipeline


@dataclass
class StepOutcome:
    loss: torch.Tensor  # this rank's (the last stage's under pipelining), not yet reduced
    grad_norm: torch.Tensor
    lr: float
    data_seconds: float
    # A MoE model's expert load (moe/balance.py); empty for a dense one.
    expert_load: dict[str, float] = field(default_factory=dict)


def build_pipeline(job: ResolvedJob, model: ModelParts, mesh: ParallelMesh, device: torch.device) -> "Pipeline":
    """The schedule over this rank's stages, local_batch_size / microbatch_size microbatches a step."""
    from titan_exp.parallel.pipeline import Pipeline  # ~0.5 s of import: only pipelined jobs pay it

    return Pipeline(
        model, job.config.parallelism, mesh.pp_group, device, job.pipeline_microbatches, cross_entropy_loss, uncounted
    )


class ForwardBackward:
    """Forward and backward over the microbatches of one step (gradients accumulate in the
    parameters); returns (this rank's loss, seconds spent fetching batches). Under pipelining the
    schedule runs the microbatches and only the last stage's rank sees the loss."""

    def __init__(
        self,
        job: ResolvedJob,
        parts: list[torch.nn.Module],
        pipeline: "Pipeline | None",
        mesh: ParallelMesh,
        loader: BatchLoader,
        device: torch.device,
    ):
        """`parts`: this rank's model parts (its stages under pipelining, else the one model)."""
        dims = job.dims
        self.model, self.pipeline, self.loader, self.device = parts[0], pipeline, loader, device
        self.accumulation = job.accumulation
        param_dtype = getattr(torch, job.config.training.mixed_precision_param)
        context_parallel_impl = job.config.parallelism.context_parallel_impl
        data_parallel = dims.fsdp_enabled or dims.ddp_enabled
        self.sync_gradients_last_only = data_parallel and job.config.training.gradient_sync == "last_microbatch"
        seq_len = loader.plan.seq_len
        self.sequence_context = (
            build_context_parallel(context_parallel_impl, parts, mesh["cp"], seq_len) if dims.cp > 1 else None
        )
        # Without FSDP/DDP (single device, TP only), the param dtype becomes an autocast dtype.
        autocast = dims.dp == 1 and param_dtype != torch.float32
        self.autocast = (lambda: torch.autocast(device.type, dtype=param_dtype)) if autocast else contextlib.nullcontext
        # Under TP the logits stay sharded over the vocabulary; the loss and its backward run on the shards.
        self.loss_context = loss_parallel if dims.tp > 1 else contextlib.nullcontext
        self.loss_fn = compiled_loss(job) or cross_entropy_loss
        # model.attn_mask_type=block_causal: each token attends within its document only.
        self.by_document = job.config.model.attn_mask_type == "block_causal"
        # A MoE layer's auxiliary loss is scaled as the loss is: by 1 / microbatches, which a
        # pipeline schedule does itself.
        for part in parts:
            for module in part.modules():
                if isinstance(module, MoE):
                    module.aux_loss_scale = 1.0 if pipeline else 1 / self.accumulation

    @torch.no_grad()
    def loss_only(self, loader: BatchLoader, index: int) -> torch.Tensor:
        """The mean loss of global batch `index` of `loader` (the held-out split), forward only, in
        the layout the training step runs: this rank's part of it (reduce with global_loss)."""
        total = torch.zeros((), device=self.device)
        for micro in range(self.accumulation):
            batch = tuple(t.to(self.device, non_blocking=True) for t in loader.get(index, micro))
            sequence = self.sequence_context(*batch) if self.sequence_context else contextlib.nullcontext(batch)
            with sequence as (inputs, labels), self.loss_context():
                documents = self._documents(loader, inputs)
                if self.pipeline:
                    total += self.pipeline.step(inputs, labels, documents, forward_only=True) / self.accumulation
                    continue
                with self.autocast():
                    logits = self.model(inputs, documents)
                loss = self.loss_fn(logits, labels) / self.accumulation
            total += loss.full_tensor() if isinstance(loss, DTensor) else loss
        return total

    def __call__(self, step: int) -> tuple[torch.Tensor, float]:
        data_seconds = 0.0
        step_loss = torch.zeros((), device=self.device)
        for micro in range(self.accumulation):
            start = time.perf_counter()
            batch = tuple(t.to(self.device, non_blocking=True) for t in self.loader.get(step - 1, micro))
            data_seconds += time.perf_counter() - start
            # Under context parallelism: this rank's slice of the sequences.
            sequence = self.sequence_context(*batch) if self.sequence_context else contextlib.nullcontext(batch)
            if self.pipeline:
                with sequence as (inputs, labels), self.loss_context():
                    step_loss += self.pipeline.step(inputs, labels, self._documents(self.loader, inputs))
                continue
            if self.sync_gradients_last_only:  # training.gradient_sync=last_microbatch
                self.model.set_requires_gradient_sync(micro == self.accumulation - 1)
            with sequence as (inputs, labels):
                with self.autocast():
                    logits = self.model(inputs, self._documents(self.loader, inputs))
                with self.loss_context():
                    loss = self.loss_fn(logits, labels) / self.accumulation
                    loss.backward()
            step_loss += loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        return step_loss, data_seconds

    def _documents(self, loader: BatchLoader, inputs: torch.Tensor) -> torch.Tensor | None:
        """Each input token's document (block_causal), None where tokens attend causally."""
        return document_ids(inputs, loader.document_end) if self.by_document else None


class NonFiniteTraining(RuntimeError):
    """The loss or the gradients stopped being finite numbers; the weights are left as they were."""


class TrainStep:
    """One optimizer step: `forward_backward`, then `update` (a dry run tracks the memory of the
    first alone)."""

    def __init__(
        self,
        job: ResolvedJob,
        model: ModelParts,
        mesh: ParallelMesh,
        forward_backward: ForwardBackward,
        optimizers: Optimizers,
        expert_balance: ExpertBalance | None = None,
    ):
        self.job, self.model, self.mesh = job, model, mesh
        self.forward_backward, self.optimizers, self.expert_balance = forward_backward, optimizers, expert_balance
        self.parameters = model.parameters

    def __call__(self, step: int) -> StepOutcome:
        loss, data_seconds = self.forward_backward(step)
        return self.update(step, loss, data_seconds)

    def update(self, step: int, loss: torch.Tensor, data_seconds: float = 0.0) -> StepOutcome:
        """Clip, check, update; the step's outcome."""
        reduce_partial_gradients(self.parameters)
        grad_norm = clip_grad_norm_(self.parameters, self.job.config.training.max_norm, self.mesh.pp_group)
        # The global norm: every rank stops at the same step. A dry run's fake tensors hold no value.
        if not is_fake(grad_norm) and not torch.isfinite(grad_norm):
            raise NonFiniteTraining(
                f"step {step}: the gradient norm is {grad_norm.item()} (this rank's loss {loss.item():.4g}); "
                "stopped before the optimizer update. Lower optimizer.lr, check the model's config, "
                "or resume from the last checkpoint"
            )
        lr = self.optimizers.lr
        self.optimizers.step()
        for part in self.model.parts:
            after_optimizer_step(part, self.job.config.quantize)
        expert_load = self.expert_balance.after_step() if self.expert_balance else {}
        return StepOutcome(loss, grad_norm, lr, data_seconds, expert_load)


def global_loss(loss: torch.Tensor, mesh: ParallelMesh) -> tuple[float, float]:
    """(average, max) of the step's loss over the data-parallel (and context-parallel) ranks, known
    to every rank (collectives: every rank must call it)."""
    if mesh.pp_group is not None:
        loss = loss.clone()
        dist.all_reduce(loss, group=mesh.pp_group)  # only the last stage's rank holds a non-zero loss
    loss_group = mesh.loss_group
    if loss_group is None:
        return loss.item(), loss.item()
    total, peak = loss.clone(), loss.clone()
    dist.all_reduce(total, group=loss_group)  # gloo has no AVG
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=loss_group)
    return total.item() / dist.get_world_size(loss_group), peak.item()

"""Dry runs: configs checked and sized without the ranks they describe.

COMM_MODE=fake_backend: one process plays rank 0 of the full world, on the fake process group. The
model parts are built for the real mesh (train/model_parts.py, as in training), then materialized
under FakeTensorMode (shapes and dtypes only, no storage) and put through one step (forward and
backward of every microbatch, then the optimizer) while torch's memory tracker counts what rank 0
would hold. Collectives are no-ops,
so this validates the mesh, the parallelization plans and the step's shapes for configs far beyond
this machine, and estimates rank 0's memory (tracked peak of forward + backward, plus AdamW's two
fp32 moments per local parameter); it measures no speed. Under pipelining rank 0 runs its own
stages once with one microbatch (a schedule keeps up to pp microbatches of activations in flight:
multiply).

COMM_MODE=local_tensor: every TP rank's numbers in this one process (torch's LocalTensorMode).
"""

import contextlib
import time

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor.parallel import loss_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_exp import metric_names as names
from titan_exp.config.job import ResolvedJob
from titan_exp.data.loader import BatchLoader, BatchPlan, build_source
from titan_exp.metrics.format import format_summary
from titan_exp.models.registry import build_model
from titan_exp.optim.optimizer import Optimizers
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.train.loss import cross_entropy_loss
from titan_exp.train.model_parts import ModelParts, build_model_parts
from titan_exp.train.step import ForwardBackward, TrainStep
from titan_exp.units import GIB

CPU = torch.device("cpu")


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


@contextlib.contextmanager
def _fake_world(world_size: int):
    """This process as rank 0 of `world_size` on the fake process group (collectives do nothing).
    One world after another in a process (a plan's grid): DTensor's sharding propagation caches
    its results by mesh, and a mesh of the next world over the same ranks compares equal to this
    one's, so a cached result would hand the next world this one's destroyed process groups."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()


class RandomTokens:
    """Tokens drawn uniformly from the model's vocabulary: a dry run needs shapes, not text."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def samples(self, ids: np.ndarray) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + int(ids[0]))
        return torch.randint(self.vocab_size, (len(ids), self.seq_len + 1), generator=generator)


def _for_loop_optimizer(job: ResolvedJob) -> ResolvedJob:
    """The job with AdamW as a for-loop: foreach over-reports optimizer state under fake tensors."""
    return job.replaced(optimizer={"implementation": "for-loop"})


class StagesOnce:
    """Under pipelining, what a dry run's step runs for forward and backward in place of the
    schedule (torch's schedules vote with their peers before the first step, which the fake group
    cannot answer): rank 0's stages one after another, each once on one microbatch, fed hidden
    states where an earlier stage would have sent them. The memory model multiplies the activations
    by the microbatches a schedule keeps in flight (estimate/memory.py)."""

    def __init__(self, job: ResolvedJob, model: ModelParts, source: RandomTokens):
        self.job, self.model, self.source = job, model, source

    def __call__(self, step: int) -> tuple[torch.Tensor, float]:
        cfg, dims = self.job.config, self.job.dims
        batch = cfg.parallelism.pipeline_parallel_microbatch_size
        tokens = self.source.samples(np.arange(batch))[:, :-1]
        last_stage, loss = self.model.stage_plan.num_stages - 1, torch.zeros(())
        for stage, part in zip(self.model.stage_ids, self.model.parts):
            # Hidden states arrive sequence-sharded under tensor (sequence) parallelism.
            x = (
                tokens
                if stage == 0
                else torch.randn(batch, tokens.shape[1] // dims.tp, cfg.model.dim, requires_grad=True)
            )
            out = part(x)
            if stage == last_stage:
                with loss_parallel() if dims.tp > 1 else contextlib.nullcontext():
                    loss = cross_entropy_loss(out, tokens)
                    loss.backward()
            else:
                out.backward(torch.ones_like(out))
        return loss.detach(), 0.0


def dry_run_step(job: ResolvedJob, mesh: ParallelMesh, model: ModelParts) -> TrainStep:
    """The training step (train/step.py) of rank 0's parts on random tokens, for fake tensors,
    through every microbatch: what earlier microbatches leave (training.gradient_sync) is what
    the last one's peak stands on. Context parallelism gathers K and V (torch's ring attention
    cannot run on the fake group)."""
    job = job.replaced(parallelism={"context_parallel_impl": "allgather"})
    cfg, dims = job.config, job.dims
    t = cfg.training
    source = RandomTokens(cfg.model.vocab_size, t.seq_len, cfg.debug.seed)
    if dims.pp > 1:
        forward_backward = StagesOnce(job, model, source)
    else:
        plan = BatchPlan(t.local_batch_size, t.seq_len, dims.dp, mesh.dp_rank, job.accumulation)
        forward_backward = ForwardBackward(job, model.parts, None, mesh, BatchLoader(source, plan), CPU)
    optimizers = Optimizers.build(model.parts, cfg.optimizer, cfg.lr_scheduler, t.steps)
    return TrainStep(job, model, mesh, forward_backward, optimizers)


def fake_backend_dry_run(job: ResolvedJob) -> dict[str, float]:
    start = time.perf_counter()
    job = _for_loop_optimizer(job)
    cfg, dims, world_size = job.config, job.dims, job.dims.world_size
    with _fake_world(world_size):
        mesh = ParallelMesh(dims, "cpu")  # outside the fake mode: DeviceMesh needs real tensors
        model = build_model_parts(cfg, mesh, CPU)
        local_params = sum(_local_numel(p) for p in model.parameters)
        with FakeTensorMode(allow_non_fake_inputs=True):
            for part in model.parts:
                part.to_empty(device="cpu")
            step = dry_run_step(job, mesh, model)
            tracker = _memory_tracker(model, step.optimizers)
            with tracker:
                loss, _ = step.forward_backward(1)
            step.update(1, loss)  # validates the update's shapes; its state is counted below
    peak = _peak_by_category(tracker)
    # AdamW keeps two fp32 moments per parameter. Counted from the shards rather than tracked: the
    # tracker over-reports optimizer state under fake tensors.
    optimizer_bytes = 2 * 4 * local_params
    return {
        "world_size": world_size,
        "layout": dims.label(),
        "mesh": dims.describe(),
        "stages_on_rank0": model.stage_ids if dims.pp > 1 else "all",
        "total_params": model.num_params,
        "rank0_params": local_params,
        **{f"rank0_step_peak_{k.lower()}_gib": v / GIB for k, v in peak.items() if v},
        "rank0_optimizer_state_gib": optimizer_bytes / GIB,
        "rank0_estimated_peak_gib": (peak["Total"] + optimizer_bytes) / GIB,
        "seconds": time.perf_counter() - start,
    }


def _memory_tracker(model: ModelParts, optimizers: Optimizers) -> MemTracker:
    """torch's tracker of rank 0's memory by category (params, grads, activations, ...)."""
    parts = model.parts
    if len(parts) == 1 and isinstance(parts[0], FSDPModule):
        return FSDPMemTracker(parts[0], optimizers.optimizers[0])
    tracker = MemTracker()
    tracker.track_external(*parts, *optimizers.optimizers)
    return tracker


def _peak_by_category(tracker: MemTracker) -> dict[str, int]:
    """The tracked peak bytes by category, summed over devices."""
    device_peak: dict[str, int] = {}
    for per_device in tracker.get_tracker_snapshot("peak").values():
        for category, value in per_device.items():
            name = getattr(category, "value", str(category)).replace(" ", "_")
            device_peak[name] = device_peak.get(name, 0) + value
    return device_peak


def local_tensor_run(job: ResolvedJob) -> list[list[float]]:
    """COMM_MODE=local_tensor, for the layouts it supports (tensor parallelism; config/check.py
    refuses the rest): trains training.steps steps of the training step (train/step.py) and returns,
    per step, each rank's loss (they must agree: the loss is replicated)."""
    job = _for_loop_optimizer(job)
    cfg, dims, world_size = job.config, job.dims, job.dims.world_size
    t = cfg.training
    # Weights drawn in full outside the mode (seeded init is data-dependent, which LocalTensorMode
    # cannot trace), then sliced per rank inside it, exactly as init_weights does on real ranks.
    full = build_model(cfg.model)
    full.init_weights(cfg.debug.seed)
    loader = BatchLoader(
        build_source(cfg.data, t.seq_len, cfg.debug.seed), BatchPlan(t.local_batch_size, t.seq_len, 1, 0, 1)
    )
    losses = []
    with _fake_world(world_size), LocalTensorMode(world_size):
        mesh = ParallelMesh(dims, "cpu")
        model = build_model_parts(cfg, mesh, CPU)
        [part] = model.parts
        part.to_empty(device="cpu")
        part.freqs_cis = full.freqs_cis.clone()
        with torch.no_grad():
            for param, reference in zip(part.parameters(), full.parameters()):
                param.copy_(
                    distribute_tensor(reference.detach(), param.device_mesh, param.placements, src_data_rank=None)
                )
        forward_backward = ForwardBackward(job, model.parts, None, mesh, loader, CPU)
        optimizers = Optimizers.build(model.parts, cfg.optimizer, cfg.lr_scheduler, t.steps)
        step = TrainStep(job, model, mesh, forward_backward, optimizers)
        for index in range(1, t.steps + 1):
            values = _per_rank(step(index).loss, world_size)
            print(f"step {index:5d}  loss per rank " + "  ".join(f"{v:.6f}" for v in values), flush=True)
            losses.append(values)
    return losses


def run(job: ResolvedJob) -> dict[str, object]:
    """The dry run COMM_MODE names, in this process; what it found (rank 0's memory, or the last loss)."""
    world_size = job.dims.world_size
    if job.config.debug.comm_mode == "fake_backend":
        report = fake_backend_dry_run(job)
        print(f"dry run (fake_backend), rank 0 of {world_size}: {format_summary(report)}", flush=True)
        return report
    losses = local_tensor_run(job)
    if any(max(step) - min(step) > 1e-6 * abs(step[0]) for step in losses):
        raise RuntimeError("ranks disagree on the loss under local_tensor: the layout is not replicating it")
    return {names.LOSS: losses[-1][0]}


def _per_rank(loss: torch.Tensor, world_size: int) -> list[float]:
    """Each rank's value of a (replicated) loss under LocalTensorMode."""
    local = loss.to_local() if isinstance(loss, DTensor) else loss
    if hasattr(local, "_local_tensors"):
        return [float(local._local_tensors[r]) for r in range(world_size)]
    return [float(local)] * world_size

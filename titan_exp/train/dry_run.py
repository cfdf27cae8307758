"""Dry runs: configs checked and sized without the ranks they describe.

COMM_MODE=fake_backend: one process plays rank 0 of the full world, on the fake process group. The
model parts are built for the real mesh (train/model_parts.py, as in training), then materialized
under FakeTensorMode (shapes and dtypes only, no storage) and put through one forward, backward and
optimizer step while torch's memory tracker counts what rank 0 would hold. Collectives are no-ops,
so this validates the mesh, the parallelization plans and the step's shapes for configs far beyond
this machine, and estimates rank 0's memory (tracked peak of forward + backward, plus AdamW's two
fp32 moments per local parameter); it measures no speed. Under pipelining rank 0 runs its own
stages once with one microbatch (a schedule keeps up to pp microbatches of activations in flight:
multiply).

COMM_MODE=local_tensor: every TP rank's numbers in this one process (torch's LocalTensorMode).
"""

import contextlib
import dataclasses
import time

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

from titan_exp.config.job import ResolvedJob
from titan_exp.config.schema import JobConfig
from titan_exp.data.loader import BatchLoader, BatchPlan, build_source
from titan_exp.metrics.format import format_summary
from titan_exp.models.llama3.model import Transformer
from titan_exp.optim.grad_clip import clip_grad_norm_
from titan_exp.optim.lr_schedule import build_lr_scheduler
from titan_exp.optim.optimizer import build_optimizer
from titan_exp.parallel.context import AllGatherContextParallel
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.train.loss import cross_entropy_loss
from titan_exp.train.model_parts import ModelParts, build_model_parts
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


def fake_backend_dry_run(job: ResolvedJob) -> dict[str, float]:
    start = time.perf_counter()
    cfg, dims, world_size = job.config, job.dims, job.dims.world_size
    with _fake_world(world_size):
        mesh = ParallelMesh(dims, "cpu")  # outside the fake mode: DeviceMesh needs real tensors
        model = build_model_parts(cfg, mesh, CPU)
        params = model.parameters
        local_params = sum(_local_numel(p) for p in params)
        with FakeTensorMode(allow_non_fake_inputs=True):
            for part in model.parts:
                part.to_empty(device="cpu")
            # foreach=True over-reports optimizer state under fake tensors; for-loop AdamW is exact.
            optimizer = torch.optim.AdamW(params, lr=cfg.optimizer.lr, foreach=False)
            peak = _tracked_forward_backward(cfg, mesh, model, optimizer)
            optimizer.step()  # validates the update's shapes; its state is counted below
            optimizer.zero_grad()
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


def _tracked_forward_backward(cfg: JobConfig, mesh: ParallelMesh, model: ModelParts, optimizer) -> dict[str, int]:
    """Peak bytes by category (params, grads, activations, …) over one forward and backward. Under
    context parallelism rank 0 holds its slice of the sequence and gathers K and V in every attention
    layer (the all-gather attention: torch's ring attention cannot run on the fake process group)."""
    t, dims = cfg.training, mesh.dims
    batch = t.local_batch_size if dims.pp == 1 else cfg.parallelism.pipeline_parallel_microbatch_size
    parts = model.parts
    if len(parts) == 1 and isinstance(parts[0], FSDPModule):
        tracker = FSDPMemTracker(parts[0], optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(*parts, optimizer)
    tokens = torch.randint(cfg.model.vocab_size, (batch, t.seq_len))
    if dims.cp > 1:
        tokens = AllGatherContextParallel(parts, mesh["cp"], t.seq_len).shard(tokens)
    last_stage = model.stage_plan.num_stages - 1
    with tracker:
        for stage, part in zip(model.stage_ids, parts):
            if stage == 0:
                x = tokens
            else:
                # Hidden states arrive sequence-sharded under tensor (sequence) parallelism.
                x = torch.randn(batch, tokens.shape[1] // dims.tp, cfg.model.dim, requires_grad=True)
            out = part(x)
            if stage == last_stage:
                with loss_parallel() if dims.tp > 1 else contextlib.nullcontext():
                    cross_entropy_loss(out, tokens).backward()
            else:
                out.backward(torch.ones_like(out))
    snapshot = tracker.get_tracker_snapshot("peak")
    device_peak: dict[str, int] = {}
    for per_device in snapshot.values():
        for category, value in per_device.items():
            name = getattr(category, "value", str(category)).replace(" ", "_")
            device_peak[name] = device_peak.get(name, 0) + value
    return device_peak


def local_tensor_run(job: ResolvedJob) -> list[list[float]]:
    """COMM_MODE=local_tensor, for the layouts it supports (tensor parallelism; config/check.py
    refuses the rest): trains training.steps steps and returns, per step, each rank's loss (they
    must agree: the loss is replicated)."""
    cfg, dims, world_size = job.config, job.dims, job.dims.world_size
    t = cfg.training
    # Weights drawn in full outside the mode (seeded init is data-dependent, which LocalTensorMode
    # cannot trace), then sliced per rank inside it, exactly as init_weights does on real ranks.
    full = Transformer(cfg.model)
    full.init_weights(cfg.debug.seed)
    loader = BatchLoader(
        build_source(cfg.data, t.seq_len, cfg.debug.seed), BatchPlan(t.local_batch_size, t.seq_len, 1, 0, 1)
    )
    losses = []
    with _fake_world(world_size), LocalTensorMode(world_size):
        [model] = build_model_parts(cfg, ParallelMesh(dims, "cpu"), CPU).parts
        model.to_empty(device="cpu")
        model.freqs_cis = full.freqs_cis.clone()
        with torch.no_grad():
            for param, reference in zip(model.parameters(), full.parameters()):
                param.copy_(
                    distribute_tensor(reference.detach(), param.device_mesh, param.placements, src_data_rank=None)
                )
        optimizer = build_optimizer(model.parameters(), dataclasses.replace(cfg.optimizer, implementation="for-loop"))
        scheduler = build_lr_scheduler(optimizer, t.steps, cfg.lr_scheduler)
        for step in range(1, t.steps + 1):
            inputs, labels = loader.get(step - 1, 0)
            with loss_parallel() if dims.tp > 1 else contextlib.nullcontext():
                loss = cross_entropy_loss(model(inputs), labels)
                loss.backward()
            clip_grad_norm_(list(model.parameters()), t.max_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            values = _per_rank(loss.detach(), world_size)
            print(f"step {step:5d}  loss per rank " + "  ".join(f"{v:.6f}" for v in values), flush=True)
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
    return {"loss/global_avg": losses[-1][0]}


def _per_rank(loss: torch.Tensor, world_size: int) -> list[float]:
    """Each rank's value of a (replicated) loss under LocalTensorMode."""
    local = loss.to_local() if isinstance(loss, DTensor) else loss
    if hasattr(local, "_local_tensors"):
        return [float(local._local_tensors[r]) for r in range(world_size)]
    return [float(local)] * world_size

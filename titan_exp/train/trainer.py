"""What one rank process does: join the process group, build the mesh, build this rank's model
parts, materialize and initialize (or load) them, and train, logging on rank 0."""

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from launchers.env import RankEnv, wait_for_rendezvous
from launchers.signals import StopRequested, stop_requested
from titan_exp.checkpoint.layout import step_dir
from titan_exp.checkpoint.manager import TrainCheckpointer, load_model, save_model
from titan_exp.config.schema import JobConfig
from titan_exp.data.loader import BatchLoader, BatchPlan, build_source
from titan_exp.data.text import prepare_tokens
from titan_exp.metrics import startup
from titan_exp.metrics.flops import flops_per_token
from titan_exp.metrics.format import format_line, format_summary
from titan_exp.metrics.peak_flops import cpu_peak_flops, gpu_peak_flops
from titan_exp.metrics.throughput import ThroughputMeter
from titan_exp.optim.grad_clip import clip_grad_norm_
from titan_exp.optim.lr_schedule import build_lr_scheduler
from titan_exp.optim.optimizer import build_optimizer
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.profiling.profiler import RankProfiler
from titan_exp.quantize.float8 import after_optimizer_step
from titan_exp.tracking.writer import BackgroundTracker
from titan_exp.train.loss import cross_entropy_loss
from titan_exp.train.model_parts import ModelParts, build_model_parts
from titan_exp.train.step import ForwardBackward, global_loss


def train(
    cfg: JobConfig, env: RankEnv, tracker: BackgroundTracker | None = None, job_dir: Path = Path(".")
) -> dict[str, float]:
    """Run the job as rank `env.rank`; returns rank 0's last logged metrics (empty elsewhere).
    `tracker`: rank 0's MLflow writer, started by the caller (job/rank_entry.py); `job_dir`: where
    profiling writes."""
    device = select_device(cfg.launcher.device, env.local_rank)
    set_determinism(cfg.debug.seed, cfg.debug.deterministic)
    peak_flops = 0.0
    if env.rank == 0:
        # On CPU, measured while nothing else runs: the other ranks wait in the rendezvous and
        # rank 0's MLflow writer is paused.
        with tracker.paused() if tracker else contextlib.nullcontext():
            peak_flops = _peak_flops(cfg, device)
    startup.mark("peak_flops")
    with _process_group(env, device):
        startup.mark("process_group")
        return _build_and_train(cfg, env, device, peak_flops, tracker, job_dir)


def _build_and_train(
    cfg: JobConfig,
    env: RankEnv,
    device: torch.device,
    peak_flops: float,
    tracker: BackgroundTracker | None,
    job_dir: Path,
) -> dict[str, float]:
    """Inside the process group: build the model, then train (or write a seed checkpoint). Its own
    function so that the model and mesh, which hold the process groups, are gone when it returns."""
    mesh = ParallelMesh(ParallelDims.from_config(cfg.parallelism), device.type)
    model = build_model_parts(cfg, mesh, device)
    _materialize(model, cfg, device)
    startup.mark("model")
    if cfg.checkpoint.create_seed_checkpoint:
        return _write_seed_checkpoint(model, cfg, env)
    return _train_steps(cfg, env, mesh, model, device, peak_flops, tracker, job_dir)


def select_device(device: str, local_rank: int) -> torch.device:
    """`device`: cuda or cpu (resolved by config/resolve.py); one GPU per local rank (the GPU of
    the local rank's index among those visible, or the only one visible)."""
    if device != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("launcher.device=cuda but torch sees no CUDA device; use launcher.device=cpu")
    visible = torch.cuda.device_count()
    # Slurm may bind each task to a GPU of its own (one CUDA_VISIBLE_DEVICES entry): then it is cuda:0.
    index = 0 if visible == 1 else local_rank
    if index >= visible:
        raise RuntimeError(f"local rank {local_rank} has no GPU of its own: {visible} visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def set_determinism(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def _peak_flops(cfg: JobConfig, device: torch.device) -> float:
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    return cpu_peak_flops(getattr(torch, cfg.training.mixed_precision_param), cfg.data.cache_dir)


@contextlib.contextmanager
def _process_group(env: RankEnv, device: torch.device) -> Iterator[None]:
    """Joined (nccl on CUDA, gloo on CPU) while inside, for a world of more than one."""
    if env.world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(minutes=10)
        if env.rank != 0:
            wait_for_rendezvous(timeout.total_seconds())
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    try:
        yield
        if dist.is_initialized():
            # No rank tears its process group down while another is still in a last collective
            # (seen once: a torchrun rank aborting at exit, "terminate called without an active exception").
            dist.barrier()
    finally:
        if dist.is_initialized():
            # FSDP2's modules hold the groups in reference cycles: freed now, the groups are destroyed
            # below and not during interpreter shutdown, where a gloo group can abort the process
            # (the same message; pytorch/pytorch#179291).
            gc.collect()
            dist.destroy_process_group()


def _materialize(model: ModelParts, cfg: JobConfig, device: torch.device) -> None:
    """Real tensors on `device`, initialized from the seed (layout-independent) or loaded."""
    for part in model.parts:
        part.to_empty(device=device)
        part.init_weights(cfg.debug.seed)
        if cfg.checkpoint.initial_load_path:
            load_model(part, cfg.checkpoint.initial_load_path)
        part.train()


def _write_seed_checkpoint(model: ModelParts, cfg: JobConfig, env: RankEnv) -> dict[str, float]:
    path = save_model(model.parts[0], cfg.checkpoint.folder)  # one rank, one part (config/check.py)
    _log0(env, f"seed checkpoint written to {path}; load it with checkpoint.initial_load_path={path}")
    return {}


@dataclass
class _Optimizers:
    """One optimizer (and schedule) per model part, so checkpoints address state by parameter name."""

    optimizers: list[torch.optim.Optimizer]
    schedulers: list

    @classmethod
    def build(cls, model: ModelParts, cfg: JobConfig) -> "_Optimizers":
        optimizers = [build_optimizer(part.parameters(), cfg.optimizer) for part in model.parts]
        schedulers = [build_lr_scheduler(o, cfg.training.steps, cfg.lr_scheduler) for o in optimizers]
        return cls(optimizers, schedulers)

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def step(self) -> None:
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)


def _pipeline(cfg: JobConfig, mesh: ParallelMesh, model: ModelParts, device: torch.device):
    """The schedule over this rank's stages, local_batch_size / microbatch_size microbatches a step."""
    from titan_exp.parallel.pipeline import Pipeline  # ~0.5 s of import: only pipelined jobs pay it

    n_microbatches = cfg.training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size
    return Pipeline(
        model.parts,
        model.stage_ids,
        model.stage_plan,
        cfg.parallelism,
        mesh.pp_group,
        device,
        n_microbatches,
        cross_entropy_loss,
    )


def _batch_loader(cfg: JobConfig, env: RankEnv, mesh: ParallelMesh, accumulation: int) -> BatchLoader:
    if env.local_rank == 0 and cfg.data.source == "text":
        prepare_tokens(cfg.data)  # once per node; the others wait below and read the cache
    if dist.is_initialized():
        dist.barrier()
    t = cfg.training
    plan = BatchPlan(t.local_batch_size, t.seq_len, mesh.dims.dp, mesh.dp_rank, accumulation)
    return BatchLoader(build_source(cfg.data, t.seq_len, cfg.debug.seed), plan)


def _train_steps(
    cfg: JobConfig,
    env: RankEnv,
    mesh: ParallelMesh,
    model: ModelParts,
    device: torch.device,
    peak_flops: float,
    tracker: BackgroundTracker | None,
    job_dir: Path,
) -> dict[str, float]:
    """Resume if there is a checkpoint, then train cfg.training.steps steps, logging on rank 0."""
    t, dims = cfg.training, mesh.dims
    pipeline = _pipeline(cfg, mesh, model, device) if dims.pp > 1 else None
    optimizers = _Optimizers.build(model, cfg)
    checkpointer = TrainCheckpointer(cfg.checkpoint, model.parts, optimizers.optimizers, optimizers.schedulers)
    resumed_step = checkpointer.resume()
    if resumed_step:
        _log0(env, f"resumed from {step_dir(cfg.checkpoint.folder, resumed_step)}")
    accumulation = t.global_batch_size // (t.local_batch_size * dims.dp)
    loader = _batch_loader(cfg, env, mesh, accumulation)
    param_dtype = getattr(torch, t.mixed_precision_param)
    forward_backward = ForwardBackward(
        model.parts, pipeline, mesh, loader, accumulation, device, param_dtype, cfg.parallelism.context_parallel_impl
    )

    facts = {
        "derived/num_params": model.num_params,
        "derived/flops_per_token": flops_per_token(cfg.model, model.num_params, model.num_embedding_params, t.seq_len),
        "derived/mesh": dims.describe(),
        "derived/world_size": env.world_size,
        "derived/peak_flops_per_device": peak_flops,
        "derived/global_batch_tokens": t.global_batch_size * t.seq_len,
        "derived/gradient_accumulation_steps": accumulation,
        "derived/device": device.type,
        **_placement_facts(device),
    }
    _log0(env, format_summary(facts))
    if tracker:
        tracker.log_params(facts)
    startup.mark("optimizer_data")
    meter = None
    if env.rank == 0:
        # MFU is not defined against a bf16 peak once matmuls run in lower precision (torchtitan omits it too).
        mfu_peak = None if cfg.quantize.low_precision else peak_flops
        meter = ThroughputMeter(facts["derived/flops_per_token"], mfu_peak, dims.non_data_parallel_size, device)

    params = model.parameters
    # Slurm warns a job ahead of its time limit (or preemption) with a signal: see _stop_agreed.
    watch_stop = cfg.launcher.name == "slurm"
    last: dict[str, float] = {}
    profiler = RankProfiler(
        cfg.profiling, job_dir, env.rank, device, model.parts, optimizers.optimizers, resumed_step + 1
    )
    for step in range(resumed_step + 1, t.steps + 1):
        with profiler.step(step):
            step_loss, data_seconds = forward_backward(step)
            grad_norm = clip_grad_norm_(params, t.max_norm, mesh.pp_group)
            lr = optimizers.lr
            optimizers.step()
            for part in model.parts:
                after_optimizer_step(part, cfg.quantize)
        if tracker and profiler.audit_metrics:
            tracker.log_metrics(step, profiler.take_audit_metrics())
        if meter:
            meter.add_step(t.local_batch_size * t.seq_len * accumulation, data_seconds)
        if step == 1 or step % cfg.metrics.log_freq == 0 or step == t.steps:
            loss_avg, loss_max = global_loss(step_loss, mesh)  # collectives: every rank takes part
            if meter:
                last = {
                    "loss/global_avg": loss_avg,
                    "loss/global_max": loss_max,
                    "grad_norm": grad_norm.item(),
                    "lr": lr,
                }
                last.update(meter.collect())
                if tracker:  # queued before printed: a step on the console is a step in the run
                    tracker.log_metrics(step, last)
                print(format_line(step, last), flush=True)
        if env.rank == 0 and step == resumed_step + 1:
            _report_startup(tracker, step)
        saved = checkpointer.maybe_save(step, t.steps, is_writer=env.rank == 0)
        if watch_stop and step < t.steps and _stop_agreed(device):
            if cfg.checkpoint.enable and not saved:
                checkpointer.save(step, is_writer=env.rank == 0)
            raise StopRequested(step, stop_requested() or "a peer's signal")
    profiler.close()
    _log_profiling(profiler, tracker)
    return last


def _report_startup(tracker: BackgroundTracker | None, step: int) -> None:
    """Rank 0, after its first step: where the start-up went (metrics/startup.py); a writer that
    waited for the first step starts now."""
    startup.mark("first_step")
    print(startup.summary_line(), flush=True)
    if tracker:
        tracker.log_metrics(step, startup.as_metrics())
        tracker.start()


def _log_profiling(profiler: RankProfiler, tracker: BackgroundTracker | None) -> None:
    """Every rank's profiling files into rank 0's run, once all ranks have written theirs."""
    if not profiler.enabled:
        return
    if dist.is_initialized():
        dist.barrier()
    for folder, artifact_dir in ((profiler.trace_dir, "profiling/traces"), (profiler.memory_dir, "profiling/memory")):
        if tracker and folder.is_dir():
            tracker.log_artifacts(folder, artifact_dir)


def _placement_facts(device: torch.device) -> dict[str, str]:
    """Where rank 0 ran: its cores (its affinity) and, on CUDA, the GPUs it could see."""
    facts = {"derived/cpu_set": _ranges(sorted(os.sched_getaffinity(0)))}
    if device.type == "cuda":
        facts["derived/cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    return facts


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] → '0-2,5'."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _stop_agreed(device: torch.device) -> bool:
    """Whether any rank has been asked to stop (launchers/signals.py), agreed by every rank at the
    same step boundary (one tiny all-reduce), so that they save and stop together."""
    flag = torch.tensor(1 if stop_requested() else 0, device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _log0(env: RankEnv, message: str) -> None:
    if env.rank == 0:
        print(message, flush=True)

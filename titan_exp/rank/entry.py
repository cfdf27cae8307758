"""What every rank process runs first, whoever started it (an engine of launchers/, torchrun, srun):
take its place in the job from the environment, start rank 0's MLflow writer, then import torch and
train. When the engine asks the job to stop (a time limit, a preemption), it is requeued to resume
from its checkpoint in the same MLflow run where the engine can, or its run ends KILLED.

Torch-free at import: rank 0 sets up its writer before torch is loaded; the writer's process starts
there too, or after the first step where the ranks take every core (see tracking/writer.py)."""

import contextlib
import ctypes
import gc
import os
import time
from pathlib import Path

from launchers.base import Launcher, Requeue
from launchers.devices import cpu_cores
from launchers.env import RankEnv, export_external_environment
from launchers.registry import LAUNCHERS
from launchers.signals import StopRequested
from titan_exp.checkpoint.layout import latest_step, run_id_beside
from titan_exp.checkpoint.model_record import NOT_WEIGHTS
from titan_exp.config.job import ResolvedJob
from titan_exp.job.context import RunContext
from titan_exp.job.result import JobStopped, RankResult
from titan_exp.metrics import startup
from titan_exp.rank.tracked_run import GoingOn, LeaveRunOpen, tracked_run
from titan_exp.tracking.run import changed_params, owner_beside, why_not_go_on_in


def run_rank(args: tuple[ResolvedJob, RunContext]) -> RankResult:
    """A rank's body: its last logged metrics (rank 0's are the job's), or why its engine stopped
    the job for good (see _after_stop)."""
    job, ctx = args
    started = time.monotonic()
    export_external_environment(ctx.started_by)  # torch.distributed reads RANK, MASTER_ADDR, ... from here on
    env = RankEnv.from_environ()
    engine = _engine(job, ctx)
    startup.adopt(ctx.startup)
    startup.mark("rank_imports")
    tracking = env.rank == 0 and job.store is not None
    try:
        defer = _ranks_take_every_core(job, env)
        resumed = _run_to_resume(job, ctx, engine) if tracking else None
        with tracked_run(job, ctx, resumed, defer) if tracking else contextlib.nullcontext() as tracker:
            startup.mark("writer_start")
            for line in job.resume.lines if job.resume and env.rank == 0 else ():
                print(f"titan_exp: {line}", flush=True)
            if job.placement.device == "cuda" and not {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} & set(
                os.environ
            ):
                # Read when CUDA's allocator starts: segments that grow in place rather than new ones
                # per size, as torchtitan's launch script sets (estimate/memory.py models it).
                os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
            if job.placement.device == "cpu":
                return_large_blocks_to_the_system()
            from titan_exp.train.trainer import Trainer  # torch, after the writer has started

            startup.mark("torch_import")
            try:
                metrics = Trainer.run(job, env, tracker, Path(ctx.job_dir))
            except StopRequested as stop:
                raise _after_stop(job, ctx, engine, stop, time.monotonic() - started, env.rank == 0) from None
        incomplete = ctx.left_in_journal(tracker.incomplete) if tracker is not None and tracker.incomplete else None
        return RankResult(metrics, tracking_incomplete=incomplete)
    except Requeued as requeued:
        if env.rank == 0:
            print(f"titan_exp: {requeued}", flush=True)
        engine.leave_for_requeue(env.rank == 0)  # last: the requeue ends this run of the job
    except JobStopped as stopped:  # rank 0's run ended KILLED with the reason
        return RankResult(stopped=str(stopped))
    finally:
        # The process ends next: its interpreter's teardown then leaves torch's objects to the exit
        # instead of collecting them one by one (~0.6 s at every rank's end, which the job waits for).
        gc.freeze()


# glibc's M_MMAP_THRESHOLD (malloc.h): blocks at least this large are mapped for themselves.
_M_MMAP_THRESHOLD, _MAPPED_FROM_BYTES = -3, 4 << 20


def return_large_blocks_to_the_system() -> None:
    """A CPU rank's tensors of 4 MiB and more mapped for themselves and unmapped when freed. By
    default glibc raises that threshold to the largest block freed so far (up to 32 MiB), after which
    such blocks come from its heap and stay in the process once freed: a rank accumulating gradients
    grew 25% above its live tensors over its first steps, where the memory model counts 10%. Not
    lower: at 1 MiB every activation is mapped afresh and FSDP's steps ran ~35% slower
    (docs/performance.md). Not where the environment sets glibc's MALLOC_MMAP_THRESHOLD_, nor off glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _MAPPED_FROM_BYTES)


def _ranks_take_every_core(job: ResolvedJob, env: RankEnv) -> bool:
    """CPU ranks whose threads fill this node's cores: rank 0's MLflow writer then starts after the
    first step rather than beside the ranks' own start-up (tracking/writer.py)."""
    placement = job.placement
    return placement.device == "cpu" and env.local_world_size * placement.threads_per_rank >= cpu_cores()


def _engine(job: ResolvedJob, ctx: RunContext) -> Launcher:
    """The engine that started this rank; under torchrun or srun, the job's own (it only says what a
    stop means, and torchrun's and srun's ranks are never asked to stop between steps)."""
    engine = LAUNCHERS.get(ctx.started_by)
    return engine(job.config.launcher) if engine else job.launcher


class Requeued(LeaveRunOpen):
    """The job goes back in its engine's queue and resumes from its checkpoint, in the same MLflow run."""


def _after_stop(
    job: ResolvedJob, ctx: RunContext, engine: Launcher, stop: StopRequested, elapsed_s: float, is_rank0: bool
) -> Exception:
    """Requeued if the engine puts the job back to resume (launchers/: a checkpoint, requeues left),
    else JobStopped with the engine's reason."""
    can_resume = job.config.checkpoint.enable
    try:
        return JobStopped(engine.after_stop(stop, elapsed_s, can_resume, Path(ctx.job_dir), is_rank0))
    except Requeue as requeue:
        return Requeued(str(requeue))


def _run_to_resume(job: ResolvedJob, ctx: RunContext, engine: Launcher) -> GoingOn | None:
    """The MLflow run a job goes on writing: the first run's of a job its engine started again (a
    requeue; not under torchrun or srun, whose restarts the engine does not know of), a job that
    resumes from a checkpoint the run that saved it where that run may go on (why_not_go_on_in;
    otherwise a new run), with the params it logged otherwise. Rank 0's, with tracking."""
    if ctx.started_by == engine.name and engine.restarted() and ctx.run_id_file.exists():
        return GoingOn(ctx.run_id_file.read_text().strip())
    folder = job.config.checkpoint.folder
    if job.config.checkpoint.enable and latest_step(folder) is not None and run_id_beside(folder).exists():
        run_id = run_id_beside(folder).read_text().strip()
        owner = owner_beside(run_id_beside(folder))
        if (why_not := why_not_go_on_in(job.store.uri, run_id, owner, _resume_expects(job))) is None:
            return GoingOn(run_id, changed_params(job.store.uri, run_id, job.params() | job.layout_params()))
        print(f"titan_exp: resuming from {folder} in a new MLflow run: {why_not}", flush=True)
    return None


def _resume_expects(job: ResolvedJob) -> dict[str, object]:
    """What the run of a checkpoint this job resumes from logged as the job has it: the folder, and
    each model key that shapes the weights (checkpoint/model_record.py)."""
    not_weights = tuple(f"model.{name}" for name in NOT_WEIGHTS)
    params = job.params()
    return {
        k: v
        for k, v in params.items()
        if k == "checkpoint.folder" or k.startswith("model.") and not k.startswith(not_weights)
    }

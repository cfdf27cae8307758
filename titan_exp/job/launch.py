"""The launching side of one job: run a resolved job as a dry run in this process, as this
process's own rank (under torchrun or srun), as rank processes placed by our local launcher, or as a
Slurm job we submit and follow; prepare the store first and record the outcome of a job whose ranks
died. Torch-free: the rank code is named, not imported (launchers/entrypoint.py), and torch is
imported by the ranks (and by the dry runs, which are this process's work)."""

from pathlib import Path

from launchers import slurm
from launchers.entrypoint import Entrypoint
from launchers.local import Limits, launch_local
from titan_exp.config.job import ResolvedJob
from titan_exp.job.context import RunContext
from titan_exp.job.result import RankResult, StoppedBySlurm
from titan_exp.metrics import startup
from titan_exp.rules import ConfigError
from titan_exp.tracking.journal import close_run_from_outside
from titan_exp.tracking.store import ensure_store

# What every rank runs (titan_exp/rank/entry.py), and the dry runs (titan_exp/train/dry_run.py).
RUN_RANK = Entrypoint("titan_exp.rank.entry:run_rank")
DRY_RUN = Entrypoint("titan_exp.train.dry_run:run")


class TrackingIncomplete(RuntimeError):
    """Training finished, but the store did not take all of its records (they are in the journal)."""


def run_job(job: ResolvedJob, job_dir: Path) -> dict[str, object]:
    """Run a resolved job; returns rank 0's last metrics.

    The MLflow run's status says how the job ended: FINISHED, FAILED (with a failure_reason tag)
    or KILLED (interrupted).
    """
    if job.dry_run:
        return DRY_RUN(job)
    if job.on_slurm:
        return _run_on_slurm(job, job_dir)
    started_by = job.placement.started_by
    if started_by:  # this process is one rank already
        return _outcome(RUN_RANK((job, RunContext(job_dir=str(job_dir), started_by=started_by))))
    if job.store is not None:
        ensure_store(job.config.tracking)
    startup.mark("store")
    ctx = RunContext(job_dir=str(job_dir), started_by="local", startup=startup.carried())
    placement = job.placement
    try:
        result = launch_local(
            RUN_RANK,
            (job, ctx),
            placement.nproc_per_node,
            job_dir / "ranks",
            use_gpus=placement.device == "cuda",
            limits=Limits(job.config.launcher.timeout_min, job.config.launcher.heartbeat_timeout_s),
            threads_per_rank=placement.threads_per_rank,
        )
    except BaseException as err:
        _close_run_from_outside(job, ctx, err)
        raise
    return _outcome(result)


def _outcome(result: RankResult) -> dict[str, object]:
    """Rank 0's metrics, or why they are not the whole story."""
    if result.stopped:
        raise StoppedBySlurm(result.stopped)
    if result.tracking_incomplete:
        raise TrackingIncomplete(f"training finished, but {result.tracking_incomplete}")
    return result.metrics


def _close_run_from_outside(job: ResolvedJob, ctx: RunContext, err: BaseException) -> None:
    """The ranks died of `err`: what rank 0 journaled and its log go into the run, which ends with
    the status `err` implies (a store that is down leaves that for `sync`, and says so)."""
    if job.store is None:
        return
    try:
        close_run_from_outside(
            job.config.tracking, Path(ctx.job_dir), job.run_name(), job.run_tags(ctx.started_by), err
        )
    except Exception as store_err:
        err.add_note(ctx.left_in_journal(f"{type(store_err).__name__}: {store_err}"))


def slurm_job_spec(job: ResolvedJob) -> slurm.SlurmJobSpec:
    """What a resolved job asks Slurm for."""
    placement = job.placement
    return slurm.SlurmJobSpec(
        job_name="titan_exp:" + job.run_name().replace("·", "-"),
        nodes=placement.nodes,
        tasks_per_node=placement.nproc_per_node,
        timeout_min=job.config.launcher.timeout_min,
        options=job.config.launcher.slurm_options(),
        threads_per_task=placement.threads_per_rank,
    )


def _run_on_slurm(job: ResolvedJob, job_dir: Path) -> dict[str, object]:
    """Submit the job (or only print its batch script: launcher.submit=false), then follow it to
    its end unless launcher.wait=false."""
    spec, folder, launcher = slurm_job_spec(job), job_dir / "slurm", job.config.launcher
    if not launcher.submit:
        print(slurm.batch_script(spec, folder), end="", flush=True)
        return {}
    if refused := slurm.refusal(spec, folder):  # before the store is touched: a refusal writes nothing
        raise ConfigError("launcher", "slurm", f"Slurm would refuse this job: {refused}")
    if job.store is not None:
        ensure_store(job.config.tracking)
    ctx = RunContext(job_dir=str(job_dir), started_by="slurm")
    submitted = slurm.submit(RUN_RANK, (job, ctx), spec, folder)
    logs = submitted.folder / f"{submitted.job_id}_<rank>_log.out"
    print(f"Slurm job {submitted.job_id} submitted: {spec.nodes * spec.tasks_per_node} ranks, logs {logs}", flush=True)
    if not launcher.wait:
        return {}
    try:
        # A rank lost (its node failed) requeues the job where it can resume from a checkpoint.
        requeues = launcher.max_num_node_failures if job.config.checkpoint.enable else 0
        result = slurm.wait(submitted, lambda line: print(line, flush=True), launcher.heartbeat_timeout_s, requeues)
        if result.stopped:
            raise StoppedBySlurm(result.stopped)
    except BaseException as err:
        _close_run_from_outside(job, ctx, err)
        raise
    return _outcome(result)

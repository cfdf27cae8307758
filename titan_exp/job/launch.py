"""The launching side of one job: run a resolved job as a dry run in this process, as this
process's own rank (under torchrun or srun), or as rank processes its engine places (launchers/:
this machine, a Slurm job, ...) and this process follows; prepare the store first and record the
outcome of a job whose ranks died. Torch-free: the rank code is named, not imported
(launchers/entrypoint.py), and torch is imported by the ranks (and by the dry runs, which are this
process's work)."""

from pathlib import Path

from launchers.base import JobSpec, SharedFolder
from launchers.entrypoint import Entrypoint
from titan_exp.config.job import ResolvedJob
from titan_exp.job import events
from titan_exp.job.context import RunContext
from titan_exp.job.result import JobStopped, RankResult
from titan_exp.metrics import startup
from titan_exp.rules import ConfigError
from titan_exp.tracking.journal import close_run_from_outside
from titan_exp.tracking.store import ensure_store

# What every rank runs (titan_exp/rank/entry.py), and the dry runs (titan_exp/train/dry_run.py).
RUN_RANK = Entrypoint("titan_exp.rank.entry:run_rank", result=RankResult.from_data)
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
    placement = job.placement
    if placement.started_by != job.config.launcher.name:  # torchrun or srun: this process is one rank
        return _outcome(RUN_RANK((job, RunContext(job_dir=str(job_dir), started_by=placement.started_by))))
    engine, cfg = job.launcher, job.config
    spec = JobSpec(
        name=job.run_name(),
        placement=placement,
        timeout_min=cfg.launcher.timeout_min,
        heartbeat_timeout_s=cfg.launcher.heartbeat_timeout_s,
        resumable=cfg.checkpoint.enable,
        shared_folders=_shared_folders(job),
    )
    folder = job_dir / engine.folder_name
    if (described := engine.described_only(spec, folder)) is not None:
        print(described, end="", flush=True)
        return {}
    if refused := engine.refusal(spec, folder):  # before the store is touched: a refusal writes nothing
        raise ConfigError("launcher", engine.name, refused)
    if job.store is not None:
        ensure_store(cfg.tracking)
    startup.mark("store")
    ctx = RunContext(job_dir=str(job_dir), started_by=engine.name, startup=startup.carried())
    try:
        placed = engine.place(RUN_RANK, (job, ctx), spec, folder, lambda line: print(line, flush=True))
        if placed is None:  # placed to run on by itself
            return {}
        if placed.where:
            events.emit(job_dir, events.PLACED, where=placed.where)
        result = placed.follow()
    except ConfigError:  # the engine found the job cannot run there: refused, nothing ran
        raise
    except BaseException as err:
        _close_run_from_outside(job, ctx, err)
        raise
    return _outcome(result)


def _shared_folders(job: ResolvedJob) -> tuple[SharedFolder, ...]:
    """What the ranks write that this process reads back: the SQLite store, the checkpoints (an
    engine whose nodes need not share this machine's disk checks that they see them)."""
    cfg = job.config
    folders = []
    if job.store is not None and job.store.db is not None:
        fix = "an SQLite store must be on a disk every node sees: run `mlflow server` and set tracking.uri=http://HOST:PORT"
        folders.append(SharedFolder("tracking.uri", job.store.uri, job.store.db.parent, fix))
    if cfg.checkpoint.enable:
        fix = "checkpoints must go to a folder every node sees (a shared file system): set checkpoint.folder to one"
        folder = Path(cfg.checkpoint.folder).absolute()
        folders.append(SharedFolder("checkpoint.folder", cfg.checkpoint.folder, folder, fix))
    return tuple(folders)


def _outcome(result: RankResult) -> dict[str, object]:
    """Rank 0's metrics, or why they are not the whole story."""
    if result.stopped:
        raise JobStopped(result.stopped)
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

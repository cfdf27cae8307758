"""Rank 0's side of a tracked job: its console copied into the run log, the MLflow writer, and the
run ended the way training ended. Torch-free: the writer is set up before the rank imports torch
(its process starts then, or after the first step: see tracking/writer.py)."""

import contextlib
import signal
import traceback
from collections.abc import Iterator
from pathlib import Path

from omegaconf import OmegaConf

from launchers import signals
from launchers.processes import launcher_gone
from titan_exp.checkpoint.layout import run_id_beside
from titan_exp.config.job import ResolvedJob
from titan_exp.job.context import RunContext
from titan_exp.tracking.run import outcome
from titan_exp.tracking.run_log import run_log
from titan_exp.tracking.writer import BackgroundTracker, interrupts_ignored


class LeaveRunOpen(Exception):
    """Raised through tracked_run: the writer is closed without ending the run, which a later run
    of the same job goes on writing (a requeued Slurm job)."""


@contextlib.contextmanager
def tracked_run(
    job: ResolvedJob, ctx: RunContext, resume_run_id: str | None = None, defer_writer: bool = False
) -> Iterator[BackgroundTracker]:
    """The writer of this job's run while inside (`resume_run_id`: of that unfinished run;
    `defer_writer`: its process starts at tracker.start(), see BackgroundTracker). Leaving
    normally ends the run FINISHED; an exception ends it FAILED (KILLED for an interrupt or a
    SIGTERM) with the reason, after the traceback and the log so far are recorded, LeaveRunOpen
    leaves it running. The writer is closed on every way out: one left open would hold up the
    interpreter's exit."""
    with run_log(ctx.run_log_file) as log_copy, _sigterm_raises():
        tags = job.run_tags(ctx.started_by)
        tracker = BackgroundTracker(
            job.config.tracking,
            job.run_name(),
            tags,
            (ctx.run_id_file, *([run_id_beside(job.config.checkpoint.folder)] if job.config.checkpoint.enable else [])),
            resume_run_id,
            journal_file=ctx.journal_file,
            defer_start=defer_writer,
        )
        status, reason = "FINISHED", None
        try:
            if resume_run_id is None:  # a resumed run has its config already
                _queue_config(tracker, job, ctx)
            yield tracker
        except LeaveRunOpen:
            status = None
            raise
        except BaseException as err:
            status, reason = outcome(launcher_gone() or err)
            with interrupts_ignored(), contextlib.suppress(OSError):
                log_copy.write(traceback.format_exc())
                log_copy.flush()
            raise
        finally:
            with interrupts_ignored():  # the next interrupt must not cut the record short
                tracker.log_artifact(ctx.run_log_file, "logs")
                tracker.close(status, reason)
            if tracker.incomplete:
                print(f"titan_exp: {ctx.left_in_journal(tracker.incomplete)}", flush=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM reached rank 0: torchrun's agent, srun (scancel, a time limit) stops the job."""


def _sigterm_raises() -> contextlib.AbstractContextManager[None]:
    """SIGTERM raises Terminated in rank 0 while inside, so its run ends KILLED with the reason
    instead of staying RUNNING. Only where nothing handles SIGTERM already: submitit's tasks (our
    local ranks) bypass it on purpose, for Slurm preemption; there the launcher interrupts with SIGINT."""
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return contextlib.nullcontext()
    return signals.handled(_raise_terminated, signal.SIGTERM)


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated("SIGTERM: the job was stopped by its launcher or by Slurm")


def _queue_config(tracker: BackgroundTracker, job: ResolvedJob, ctx: RunContext) -> None:
    """The resolved config and the Hydra files, as the run's first records."""
    tracker.log_params(job.params())
    tracker.log_text(OmegaConf.to_yaml(OmegaConf.structured(job.config)), "config/resolved.yaml")
    for hydra_file in sorted(Path(ctx.job_dir, ".hydra").glob("*.yaml")):
        tracker.log_text(hydra_file.read_text(), f"config/hydra/{hydra_file.name}")

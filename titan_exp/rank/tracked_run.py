"""Rank 0's side of a tracked job: its console copied into the run log, the MLflow writer, and the
run ended the way training ended. Torch-free: the writer is set up before the rank imports torch
(its process starts then, or after the first step: see tracking/writer.py)."""

import contextlib
import signal
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from launchers import signals
from launchers.processes import launcher_gone
from titan_exp.checkpoint.layout import run_id_beside
from titan_exp.config.job import ResolvedJob, Resume
from titan_exp.job.context import RunContext
from titan_exp.tracking.run import outcome
from titan_exp.tracking.run_log import run_log
from titan_exp.tracking.writer import BackgroundTracker, interrupts_ignored

# Where a resumed job's record goes in its run: resume/step-N (its lines), resume/step-N/<key> (its values).
RESUME_TAG = "resume"


@dataclass(frozen=True)
class GoingOn:
    """A run that a job goes on writing (a requeued job's, or the unfinished run of the checkpoint it
    resumes from): its id, and the job's params that the run logged otherwise."""

    run_id: str
    changed: dict[str, str] = field(default_factory=dict)


class LeaveRunOpen(Exception):
    """Raised through tracked_run: the writer is closed without ending the run, which a later run
    of the same job goes on writing (a requeued Slurm job)."""


@contextlib.contextmanager
def tracked_run(
    job: ResolvedJob, ctx: RunContext, going_on: GoingOn | None = None, defer_writer: bool = False
) -> Iterator[BackgroundTracker]:
    """The writer of this job's run while inside (`going_on`: of that unfinished run; `defer_writer`:
    its process starts at tracker.start(), see BackgroundTracker); a resumed job's record under its
    resume (_queue_resume). Leaving normally ends the run FINISHED; an exception ends it FAILED
    (KILLED for an interrupt or a SIGTERM) with the reason, after the traceback and the log so far
    are recorded, LeaveRunOpen leaves it running. The writer is closed on every way out: one left
    open would hold up the interpreter's exit."""
    with run_log(ctx.run_log_file) as log_copy, _sigterm_raises():
        tags = job.run_tags(ctx.started_by)
        tracker = BackgroundTracker(
            job.config.tracking,
            job.run_name(),
            tags,
            (ctx.run_id_file, *([run_id_beside(job.config.checkpoint.folder)] if job.config.checkpoint.enable else [])),
            going_on.run_id if going_on else None,
            journal_file=ctx.journal_file,
            defer_start=defer_writer,
        )
        status, reason = "FINISHED", None
        try:
            if going_on is None:  # a run it goes on writing has its config already
                _queue_config(tracker, job, ctx)
            if job.resume is not None:
                _queue_resume(tracker, job.resume, going_on.changed if going_on else {})
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


def _queue_resume(tracker: BackgroundTracker, resume: Resume, changed: dict[str, str]) -> None:
    """Tags under resume/step-N: what the job said of its resume from step N (job/resume.py), and
    each param of its own that the run it goes on writing logged otherwise (MLflow keeps a run's first
    params): the record says what each resume trained."""
    under = f"{RESUME_TAG}/step-{resume.step}"
    if resume.lines:
        tracker.set_tag(under, "\n".join(resume.lines))
    for key, value in changed.items():
        tracker.set_tag(f"{under}/{key}", value)

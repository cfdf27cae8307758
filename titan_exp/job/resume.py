"""A job that resumes from a checkpoint (the newest step of its checkpoint.folder) goes on as the job
that saved it trained where the user does not say otherwise: the same tokens per step unless
training.global_batch_size is set (a sweep point's held batch, job/held_batch.py, is none of its
own overrides: resumed with them alone it would train another batch). Decided in the launching
process, before any rank starts, from the step's record (checkpoint/model_record.py); each change
from the saved job (another batch, another LR schedule) is said in one line, which the job carries
(ResolvedJob.resume) to rank 0: it prints them and records them with its run. Torch-free."""

import copy
import dataclasses
from pathlib import Path

from titan_exp.checkpoint.config import OWN_FOLDER
from titan_exp.checkpoint.layout import latest_step, step_dir
from titan_exp.checkpoint.model_record import TrainedAs, trained_as
from titan_exp.config.aliases import apply_aliases
from titan_exp.config.job import ResolvedJob, Resume
from titan_exp.config.resolve import resolve
from titan_exp.config.schema import JobConfig
from titan_exp.job.held_batch import UNSET, local_batch_for
from titan_exp.optim.config import LRSchedulerConfig, lr_factor
from titan_exp.rules import ConfigError


def resolve_to_run(cfg: JobConfig, job_dir: Path | None, room: bool = True) -> ResolvedJob:
    """`cfg` resolved to run in `job_dir` (config/resolve.py; `room=False`: whether this machine
    has room for it left unasked, as `show` does); where it resumes from a checkpoint, with the
    batch it goes on with and its Resume."""
    job = resolve(cfg, job_dir=job_dir, room=room)
    c = job.config.checkpoint
    step = latest_step(c.folder) if c.enable and c.folder != OWN_FOLDER else None  # OWN_FOLDER: no job folder
    if step is None:
        return job
    where = step_dir(c.folder, step)
    saved = trained_as(where)
    lines: list[str] = []
    if saved is not None:  # a checkpoint saved before records said how its job trained: as it is
        job, lines = _same_batch(cfg, job, saved, where, job_dir, room)
        lines += _schedule_change(job, saved, step)
    return dataclasses.replace(job, resume=Resume(step, tuple(lines)))


def _same_batch(
    cfg: JobConfig, job: ResolvedJob, saved: TrainedAs, where: Path, job_dir: Path | None, room: bool
) -> tuple[ResolvedJob, list[str]]:
    """`job` training the checkpoint's tokens per step unless training.global_batch_size is set, and
    the line that says so where it differs from what the job trains by itself."""
    t, tokens = job.config.training, job.tokens_per_step
    if tokens == saved.tokens_per_step:
        return job, []
    given = copy.deepcopy(cfg)
    apply_aliases(given)  # torchtitan's training.num_tokens_per_train_step sets it too
    if given.training.global_batch_size != UNSET:
        return job, [
            f"resume: trains {tokens:,} tokens a step as training.global_batch_size={t.global_batch_size} sets, "
            f"where {where} trained {saved.tokens_per_step:,}"
        ]
    global_batch = _global_batch(job, saved, where)
    given.training.local_batch_size, given.training.global_batch_size = local_batch_for(job, global_batch), global_batch
    job = resolve(given, job_dir=job_dir, room=room)  # every rule checked again on the batch it goes on with
    local, dp = job.config.training.local_batch_size, job.dims.dp
    return job, [
        f"resume: trains {saved.tokens_per_step:,} tokens a step as {where} did: global batch {global_batch} = "
        f"local batch {local} × {dp} data-parallel ranks × accumulation {job.accumulation} (by itself it "
        f"would train {tokens:,}; training.global_batch_size sets another)"
    ]


def _global_batch(job: ResolvedJob, saved: TrainedAs, where: Path) -> int:
    """The sequences a step that train the checkpoint's tokens per step in `job`'s layout."""
    t, dp = job.config.training, job.dims.dp
    global_batch, left = divmod(saved.tokens_per_step, t.seq_len)
    if left or global_batch % dp:
        raise ConfigError(
            "training.global_batch_size",
            UNSET,
            f"{where} trained {saved.tokens_per_step:,} tokens a step, not whole sequences of training.seq_len="
            f"{t.seq_len} that split over {dp} data-parallel ranks; set it to go on with another batch",
        )
    return global_batch


def _schedule_change(job: ResolvedJob, saved: TrainedAs, step: int) -> list[str]:
    """The line that says how the LR schedule changes from the checkpoint's (another training.steps,
    optimizer.lr or lr_scheduler), by the LRs on either side of the resume, each from its schedule."""
    cfg = job.config
    ours = _schedule_keys(cfg.training.steps, cfg.optimizer.lr, cfg.lr_scheduler)
    theirs = _schedule_keys(saved.steps, saved.lr, saved.lr_scheduler)
    changed = [f"{key} {theirs[key]} → {value}" for key, value in ours.items() if value != theirs[key]]
    if not changed:
        return []
    # lr_factor counts steps from 0: step N+1, the first this job trains, is its step N.
    runs = cfg.optimizer.lr * lr_factor(step, cfg.training.steps, cfg.lr_scheduler)
    ran = saved.lr * lr_factor(step - 1, saved.steps, saved.lr_scheduler)
    return [
        f"resume: {', '.join(changed)}: the LR schedule changes: step {step + 1} runs {runs:.2e} "
        f"(step {step} ran {ran:.2e} under the checkpoint's {saved.steps}-step schedule)"
    ]


def _schedule_keys(steps: int, lr: float, schedule: LRSchedulerConfig) -> dict[str, object]:
    named = {f"lr_scheduler.{key}": value for key, value in dataclasses.asdict(schedule).items()}
    return {"training.steps": steps, "optimizer.lr": lr, **named}

"""Layouts compared on the same work: the points of a sweep or a plan grid train the same tokens per
optimizer step (`sweep.batch=global`, the default), whatever their data-parallel degree; torchtitan
calls the figure num_tokens_per_train_step. `training.local_batch_size` is per data-parallel rank, so
without this a tp2 point beside an fsdp2 one trains half the sequences a step, and its loss and
throughput say nothing about the layout.

The held figure is the first point's tokens per step (its global batch × seq_len: the batch it sets
with training.global_batch_size, else its local batch × data-parallel degree). Each other point
trains that many tokens: its global batch from its seq_len, its local batch the largest that divides
its share and is no larger than the one it sets (the per-rank memory the user chose), the rest
accumulated (a pipelined point, which cannot accumulate, takes its whole share per microstep). A point
that sets training.global_batch_size trains that. Points that set different local batches keep them
(the sweep compares batches), as `sweep.batch=per_rank` keeps every point's: each global batch then
follows its data-parallel degree. Torch-free."""

import copy
import dataclasses
import math
from collections.abc import Callable

from titan_exp.config.job import ResolvedJob
from titan_exp.config.schema import JobConfig
from titan_exp.rules import ConfigError

UNSET = -1  # training.global_batch_size's default: the local batch × data-parallel degree
# What a sweep that varies them compares: then each point keeps its own.
BATCH_KEYS = ("training.local_batch_size", "training.global_batch_size")


@dataclasses.dataclass(frozen=True)
class HeldBatch:
    """What holding did: the tokens per step held (None: nothing held, and why) and one line per
    point changed."""

    tokens_per_step: int | None
    changes: list[str]
    not_held: str = ""


def hold_global_batch(
    configs: list[JobConfig],
    labels: list[str],
    resolver: Callable[[JobConfig], ResolvedJob],
    tokens_per_step: int | None = None,
) -> tuple[list[JobConfig | ConfigError], HeldBatch]:
    """Each point's config with its batch set to train `tokens_per_step` (default: the first
    resolvable point's), or its own training.global_batch_size where it sets one, or why it cannot
    (a ConfigError naming the nearest batch every point can train). A point that does not resolve
    is passed on as it is: its own refusal comes when it is resolved."""
    if configs[0].sweep.batch != "global":
        return list(configs), HeldBatch(None, [], "sweep.batch=per_rank")
    if len({cfg.training.local_batch_size for cfg in configs}) > 1:  # holding would undo what is swept
        return list(configs), HeldBatch(None, [], "the points set their own training.local_batch_size")
    resolved = [_dims_of(cfg, resolver) for cfg in configs]
    first = next((job for job in resolved if job is not None), None)
    if first is None:
        return list(configs), HeldBatch(None, [], "no point resolves")
    if tokens_per_step is None:
        tokens_per_step = _own_global_batch(first) * first.config.training.seq_len
    every_dp = math.lcm(*(job.dims.dp for job in resolved if job is not None))
    held: list[JobConfig | ConfigError] = []
    changes = []
    for cfg, job, label in zip(configs, resolved, labels):
        if job is None:
            held.append(cfg)
            continue
        t, dp, own = job.config.training, job.dims.dp, _own_global_batch(job)
        tokens = own * t.seq_len if t.global_batch_size != UNSET else tokens_per_step
        try:
            local, global_batch = _batch_for(job, tokens, every_dp)
        except ConfigError as err:
            held.append(err)
            continue
        if (local, global_batch) != (t.local_batch_size, own):
            cfg = copy.deepcopy(cfg)
            cfg.training.local_batch_size, cfg.training.global_batch_size = local, global_batch
            changes.append(
                f"{label}: global batch {global_batch} = local batch {local} × {dp} data-parallel ranks × "
                f"accumulation {global_batch // (local * dp)} (as set: {t.local_batch_size}, {own})"
            )
        held.append(cfg)
    return held, HeldBatch(tokens_per_step, changes)


def _dims_of(cfg: JobConfig, resolver: Callable[[JobConfig], ResolvedJob]) -> ResolvedJob | None:
    """`cfg` resolved but for its global batch (whose check needs the local batch derived here)."""
    unbatched = copy.deepcopy(cfg)
    unbatched.training.global_batch_size = UNSET
    try:
        job = resolver(unbatched)
    except ConfigError:
        return None
    return job.replaced(training={"global_batch_size": cfg.training.global_batch_size})


def _own_global_batch(job: ResolvedJob) -> int:
    """The global batch the point sets, or its local batch × data-parallel degree."""
    t = job.config.training
    return t.global_batch_size if t.global_batch_size != UNSET else t.local_batch_size * job.dims.dp


def _batch_for(job: ResolvedJob, tokens_per_step: int, every_dp: int) -> tuple[int, int]:
    """(local batch, global batch) for `job` to train `tokens_per_step` tokens a step; `every_dp`,
    the least global batch that splits over every point's data-parallel ranks (for the refusal)."""
    t, dp = job.config.training, job.dims.dp
    key, escape = "training.global_batch_size", "or sweep.batch=per_rank keeps each point's local batch"
    if tokens_per_step % t.seq_len:
        why = f"{tokens_per_step:,} tokens a step are not whole sequences of this point's seq_len {t.seq_len}"
        raise ConfigError(key, tokens_per_step / t.seq_len, f"{why}; set training.global_batch_size, {escape}")
    global_batch = tokens_per_step // t.seq_len
    if global_batch % dp:
        lower, higher = global_batch // every_dp * every_dp, (global_batch // every_dp + 1) * every_dp
        nearest = " or ".join(str(n) for n in (lower, higher) if n > 0)
        raise ConfigError(
            key,
            global_batch,
            f"{global_batch} sequences a step do not split over this point's {dp} data-parallel ranks; "
            f"every point can train {nearest} (set it), {escape}",
        )
    return local_batch_for(job, global_batch), global_batch


def local_batch_for(job: ResolvedJob, global_batch: int) -> int:
    """The local batch with which `job` trains `global_batch` sequences a step (a multiple of its
    data-parallel degree): the largest that divides its share and is no larger than the one it sets,
    the rest accumulated; a pipelined job takes its whole share per microstep."""
    share = global_batch // job.dims.dp
    if job.dims.pp > 1:  # gradient accumulation and pipelining do not combine (config/check.py)
        return share
    return max(n for n in range(1, min(share, job.config.training.local_batch_size) + 1) if share % n == 0)


def describe(held: HeldBatch, seq_len: int) -> str:
    """The line a sweep or plan prints: what every point trains, and what changed to train it."""
    if held.tokens_per_step is None:
        return (
            f"every point keeps its local batch ({held.not_held}): global batches differ with the data-parallel degree"
        )
    head = (
        f"every point trains {held.tokens_per_step:,} tokens a step ({held.tokens_per_step // seq_len} sequences of "
        f"{seq_len} for the first; sweep.batch=per_rank keeps each point's local batch instead)"
    )
    return "\n".join([head, *(f"  {change}" for change in held.changes)])

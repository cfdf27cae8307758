"""One rank's memory for a job: the one figure that the pre-flight check, `plan` and `plan.prune`
print for the same point. A config is turned into the memory model's Workload (estimate/memory.py);
a rank's budget is its device's memory less plan.memory_margin (or plan.memory_budget_gib); a point
that does not fit is refused with the nearest changes that fit by the same model."""

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from titan_exp.config.job import ResolvedJob
from titan_exp.config.schema import JobConfig
from titan_exp.data.files import document_lengths
from titan_exp.estimate.documents import flex_keys, flex_keys_of_mean
from titan_exp.estimate.memory import rank_memory
from titan_exp.estimate.workload import Workload
from titan_exp.parallel.config import ActivationCheckpointConfig, ParallelismConfig
from titan_exp.parallel.stages import StagePlan
from titan_exp.rules import ConfigError
from titan_exp.units import GIB

# How far the search for "more ranks" goes: up to this many times the job's data-parallel shards.
_MAX_RANK_FACTOR = 64


def workload(cfg: JobConfig, device: str) -> Workload:
    """What a step of the resolved `cfg` asks of each rank on `device` (cuda or cpu)."""
    t, p, q = cfg.training, cfg.parallelism, cfg.quantize
    dp = p.data_parallel_replicate_degree * p.data_parallel_shard_degree
    return Workload(
        model=cfg.model,
        parallelism=p,
        ac=cfg.activation_checkpoint,
        local_batch_size=t.local_batch_size,
        seq_len=t.seq_len,
        accumulation=max(1, t.global_batch_size // (t.local_batch_size * dp)),
        param_dtype=t.mixed_precision_param,
        reduce_dtype=t.mixed_precision_reduce,
        quantize=q.recipe if q.name == "float8" else q.name,
        float8_all_gather=q.enable_fsdp_float8_all_gather,
        compiled=cfg.compile.compiles("model"),
        loss_compiled=cfg.compile.compiles("loss"),
        async_tp=p.enable_async_tensor_parallel,
        device=device,
        expert_load_imbalance=cfg.plan.expert_load_imbalance,
        # A profile's slack is its device's: a job checked for another device leaves it out.
        allocator_slack=cfg.hardware.allocator_slack if cfg.hardware.device == device else 0.0,
        masked_keys=_masked_keys(cfg) if cfg.model.attn_mask_type == "block_causal" else None,
        optimizer=cfg.optimizer.implementation,
        pipeline_returns_outputs=cfg.plan.pipeline_returns_outputs,
        gradient_sync=t.gradient_sync,
    )


def _masked_keys(cfg: JobConfig) -> float:
    """The mean keys FlexAttention computes a query under a document mask: documents of
    plan.document_tokens, or as long as data=files' first documents are (measured), else as long
    as the window."""
    seq_len = cfg.training.seq_len
    if cfg.plan.document_tokens is not None:
        return flex_keys_of_mean(cfg.plan.document_tokens, seq_len)
    if cfg.data.source == "files":
        d = cfg.data
        return flex_keys(document_lengths(tuple(d.paths), d.tokenizer_path, d.text_field), seq_len)
    return flex_keys_of_mean(seq_len, seq_len)


def planned_device(cfg: JobConfig) -> str:
    """The device a plan or a sweep's pruning predicts for: its hardware profile's kind."""
    return cfg.hardware.device


@dataclass(frozen=True)
class Budget:
    """What each rank may use: `node_bytes` for one rank (a GPU), or shared by a node's ranks (a
    CPU machine); `where` says where the figure comes from."""

    node_bytes: float
    shared_by_ranks: bool
    where: str

    def per_rank(self, ranks_per_node: int) -> float:
        return self.node_bytes / ranks_per_node if self.shared_by_ranks else self.node_bytes

    @classmethod
    def of(cls, cfg: JobConfig, device_bytes: float, shared_by_ranks: bool, where: str) -> "Budget":
        """`device_bytes` less plan.memory_margin; plan.memory_budget_gib (per rank) where set."""
        plan = cfg.plan
        if plan.memory_budget_gib is not None:
            return cls(plan.memory_budget_gib * GIB, False, "plan.memory_budget_gib")
        margin = f"less plan.memory_margin={plan.memory_margin:g}"
        return cls(device_bytes * (1 - plan.memory_margin), shared_by_ranks, f"{where}, {margin}")


def check_memory_fit(job: ResolvedJob, budget: Budget, device: str) -> None:
    """One rank's estimated reserved peak within its budget; a refusal names the changes that fit."""
    w = workload(job.config, device)
    needed = rank_memory(w)
    ranks = job.config.launcher.nproc_per_node
    if needed.reserved <= budget.per_rank(ranks):
        return
    fixes = memory_fixes(job.config, w, budget)
    advice = f"try {' or '.join(fixes)}" if fixes else (
        "no change of activation checkpointing, batch, rank count or TP/PP degree fits by the same "
        "estimate; use devices with more memory or a smaller model"
    )  # fmt: skip
    raise ConfigError(
        "model",
        job.model_name,
        f"one rank needs about {needed.reserved / GIB:.1f} GiB ({needed.describe()}) but each can have "
        f"{budget.per_rank(ranks) / GIB:.1f} GiB ({budget.where}); {advice}",
    )


def memory_fixes(cfg: JobConfig, w: Workload, budget: Budget) -> list[str]:
    """For each kind of change (full AC, a smaller local batch, more ranks, TP ×2, PP ×2) its
    mildest option that fits `budget` by the memory model, as overrides; where none fits alone,
    full AC together with each of the others."""
    fixes = _fitting(cfg, w, budget, _changes(cfg, w))
    if fixes or w.ac.mode == "full":
        return fixes
    [(full_ac, with_full_ac, _)] = _full_ac(w)
    return [f"{full_ac} {fix}" for fix in _fitting(cfg, with_full_ac, budget, _changes(cfg, with_full_ac))]


def _fitting(cfg: JobConfig, w: Workload, budget: Budget, kinds: list[Iterator["_Change"]]) -> list[str]:
    ranks = cfg.launcher.nproc_per_node
    fixes = []
    for options in kinds:
        fitting = (
            text for text, changed, per_node in options
            if rank_memory(changed).reserved <= budget.per_rank(per_node or ranks)
        )  # fmt: skip
        fixes += [fix] if (fix := next(fitting, None)) else []
    return fixes


# One candidate: its overrides, the changed workload, the ranks per node it takes (None: the same).
_Change = tuple[str, Workload, int | None]


def _changes(cfg: JobConfig, w: Workload) -> list[Iterator[_Change]]:
    return [_full_ac(w), _smaller_batches(w), _more_ranks(cfg, w), _more_tp(w), _more_pp(w)]


def _full_ac(w: Workload) -> Iterator[_Change]:
    if w.ac.mode != "full":
        full = ActivationCheckpointConfig(mode="full")
        yield "activation_checkpoint.mode=full", dataclasses.replace(w, ac=full), None


def _smaller_batches(w: Workload) -> Iterator[_Change]:
    """Whole pipeline microbatches, the global batch kept by accumulating more microbatches."""
    p = w.parallelism
    step = p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else 1
    samples = w.local_batch_size * w.accumulation
    for batch in range(w.local_batch_size - step, 0, -step):  # the local batch is whole microbatches
        changed = dataclasses.replace(w, local_batch_size=batch, accumulation=max(1, samples // batch))
        yield f"training.local_batch_size={batch}", changed, None


def _more_ranks(cfg: JobConfig, w: Workload) -> Iterator[_Change]:
    """More FSDP shards: more processes on a node where ranks share a machine's memory, else more
    nodes."""
    p, launcher = w.parallelism, cfg.launcher
    if p.data_parallel_shard_degree <= 1:
        return
    factor = 2
    while factor <= _MAX_RANK_FACTOR:
        changed = dataclasses.replace(w, parallelism=_scaled(p, data_parallel_shard_degree=factor))
        if not launcher.engine().on_this_machine or launcher.nodes > 1 or w.device == "cuda":
            yield f"launcher.nodes={launcher.nodes * factor}", changed, None
        else:
            ranks = launcher.nproc_per_node * factor
            yield f"launcher.nproc_per_node={ranks}", changed, ranks
        factor *= 2


def _more_tp(w: Workload) -> Iterator[_Change]:
    """TP twice as wide on the same ranks (FSDP over half as many), while heads divide."""
    p, m = w.parallelism, w.model
    tp = p.tensor_parallel_degree * 2
    if p.data_parallel_shard_degree % 2 == 0 and m.n_heads % tp == 0 and m.kv_heads % tp == 0:
        changed = _scaled(p, tensor_parallel_degree=2, data_parallel_shard_degree=0.5)
        yield f"parallelism.tensor_parallel_degree={tp}", dataclasses.replace(w, parallelism=changed), None


def _more_pp(w: Workload) -> Iterator[_Change]:
    """Twice the pipeline stages on the same ranks (FSDP over half as many), while layers suffice."""
    p = w.parallelism
    if p.pipeline_parallel_degree == 1 or p.data_parallel_shard_degree % 2:
        return
    changed = _scaled(p, pipeline_parallel_degree=2, data_parallel_shard_degree=0.5)
    try:
        StagePlan.from_config(changed, w.model.n_layers)
    except (ValueError, ConfigError):
        return
    override = f"parallelism.pipeline_parallel_degree={changed.pipeline_parallel_degree}"
    yield override, dataclasses.replace(w, parallelism=changed), None


def _scaled(p: ParallelismConfig, **factors: float) -> ParallelismConfig:
    """The parallelism with the named degrees multiplied."""
    return dataclasses.replace(p, **{key: int(getattr(p, key) * factor) for key, factor in factors.items()})

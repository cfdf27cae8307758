"""Every refusal of a config, made before any rank process starts (or any store is touched).

Each rule raises ConfigError naming the key, the offending value and the fix, so the command line
prints one line and exits 2. The rules read the config and facts handed to them (world size,
visible GPUs); config/resolve.py gathers those facts and fills in what the config leaves open.
"""

import contextlib
import copy
import dataclasses
import math
import sqlite3
import tempfile
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

from titan_exp.checkpoint.layout import latest_step
from titan_exp.config.schema import JobConfig
from titan_exp.config.sections import LauncherConfig
from titan_exp.estimate.memory import GIB, RankMemory
from titan_exp.parallel.config import CONTEXT_PARALLEL_IMPLS
from titan_exp.parallel.dims import MESH_DIMS
from titan_exp.parallel.stages import SCHEDULES, StagePlan
from titan_exp.tracking.config import TrackingConfig
from titan_exp.tracking.store import is_store_busy, server_answers, sqlite_path

DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    def __init__(self, key: str, value: object, fix: str):
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key}={value}: {fix}")


def _choice(key: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(key, value, f"choose one of {', '.join(map(str, allowed))}")


def _positive(key: str, value: int | float) -> None:
    if not value > 0 or math.isinf(value):  # `not >` also refuses nan
        raise ConfigError(key, value, "must be > 0" if isinstance(value, int) else "must be a finite number > 0")


def _in_range(key: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:  # also refuses nan
        raise ConfigError(key, value, f"must lie in [{low:g}, {high:g}]")


def _writable_folder(key: str, folder: str, value: str | None = None) -> None:
    """A folder a file can be written in, found by trying (permission bits say little to root, or on
    /proc): the folder is made if missing, a file created and removed in it, and what was made for
    the try removed again."""
    if not folder:
        raise ConfigError(key, "''", "must name a folder")
    path = Path(folder).absolute()
    missing = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        fix = f"cannot write there ({err.strerror}); point it at a folder you can write"
        raise ConfigError(key, value or folder, fix) from None
    finally:
        for made in missing:  # deepest first
            with contextlib.suppress(OSError):
                made.rmdir()


def check_known_keys(tree: dict, schema: type, prefix: str = "") -> None:
    """Every key of the composed config is one of the schema's: Hydra lets `+section.key=value` add
    any key, which the typed config would then drop without a word. Free-form dicts (such as
    launcher.additional_parameters) take any key."""
    fields = typing.get_type_hints(schema)
    for key, value in tree.items():
        if key not in fields:
            raise ConfigError(
                f"{prefix}{key}", value, "is not a key of the config; check its spelling (--cfg job lists the keys)"
            )
        if dataclasses.is_dataclass(fields[key]) and isinstance(value, dict):
            check_known_keys(value, fields[key], f"{prefix}{key}.")


def check_degrees(degrees: dict[str, int], world_size: int) -> None:
    """Each degree positive or -1 (at most one), and their product the world size (or, with a -1,
    a divisor of it)."""
    for key, degree in degrees.items():
        if degree == 0 or degree < -1:
            raise ConfigError(f"parallelism.{key}", degree, "must be a positive degree or -1 (the rest of the world)")
    inferred = [key for key, degree in degrees.items() if degree == -1]
    if len(inferred) > 1:
        raise ConfigError(f"parallelism.{inferred[1]}", -1, f"only one degree may be -1 ({inferred[0]} already is)")
    fixed = math.prod(d for d in degrees.values() if d != -1)
    if inferred and world_size % fixed:
        raise ConfigError(
            f"parallelism.{inferred[0]}",
            -1,
            f"the other degrees multiply to {fixed}, which does not divide the world size {world_size}",
        )
    if not inferred and fixed != world_size:
        layout = " × ".join(f"{MESH_DIMS[k]}={d}" for k, d in degrees.items() if d > 1) or "1"
        raise ConfigError(
            "parallelism",
            layout,
            f"the degrees multiply to {fixed} but the world size is {world_size} "
            f"(launcher.nproc_per_node × launcher.nodes); make them equal or set one degree to -1",
        )


def check_model_fit(cfg: JobConfig) -> None:
    """Degrees that must divide the model's heads, kv-heads and layers."""
    p, m = cfg.parallelism, cfg.model
    tp = p.tensor_parallel_degree
    for attr in ("n_heads", "kv_heads"):
        count = getattr(m, attr)
        if count % tp:
            raise ConfigError(
                "parallelism.tensor_parallel_degree",
                tp,
                f"must divide model {attr.replace('kv_heads', 'n_kv_heads')}={count} of {m.name}_{m.flavor}",
            )
    if p.pipeline_parallel_degree > 1:
        check_pipeline(cfg)
    cp, seq_len = p.context_parallel_degree, cfg.training.seq_len
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            "parallelism.context_parallel_degree",
            cp,
            f"2 × it must divide training.seq_len={seq_len} (each rank takes two load-balanced chunks)",
        )
    if (seq_len // cp) % tp:
        where = f"training.seq_len={seq_len}" if cp == 1 else f"each cp rank's {seq_len // cp} tokens"
        raise ConfigError(
            "parallelism.tensor_parallel_degree",
            tp,
            f"must divide {where} (sequence parallelism splits the sequence)",
        )


def check_pipeline(cfg: JobConfig) -> None:
    p, m, t = cfg.parallelism, cfg.model, cfg.training
    _choice("parallelism.pipeline_parallel_schedule", p.pipeline_parallel_schedule, SCHEDULES)
    try:
        plan = StagePlan.from_config(p, m.n_layers)
    except ValueError as err:
        key = (
            "pipeline_parallel_layers_per_stage" if p.pipeline_parallel_layers_per_stage else "pipeline_parallel_degree"
        )
        raise ConfigError(f"parallelism.{key}", getattr(p, key), f"{err} (model {m.name}_{m.flavor})") from None
    mb = p.pipeline_parallel_microbatch_size
    if mb <= 0 or t.local_batch_size % mb:
        raise ConfigError(
            "parallelism.pipeline_parallel_microbatch_size",
            mb,
            f"must divide training.local_batch_size={t.local_batch_size}",
        )
    if t.local_batch_size // mb < p.pipeline_parallel_degree:
        raise ConfigError(
            "training.local_batch_size",
            t.local_batch_size,
            f"gives {t.local_batch_size // mb} microbatches, "
            f"fewer than the {p.pipeline_parallel_degree} pipeline ranks; raise it",
        )
    if p.pipeline_parallel_schedule == "DualPipeV" and t.local_batch_size // mb < plan.num_stages:
        raise ConfigError(
            "training.local_batch_size",
            t.local_batch_size,
            f"gives {t.local_batch_size // mb} microbatches; "
            f"DualPipeV needs at least one per stage ({plan.num_stages}); raise it",
        )
    if m.tie_word_embeddings:
        raise ConfigError(
            "parallelism.pipeline_parallel_degree",
            p.pipeline_parallel_degree,
            f"{m.name}_{m.flavor} ties its embeddings to the output, which sit on different stages",
        )


def check_supported_layout(cfg: JobConfig) -> None:
    """Layouts whose code has not landed yet are refused by name rather than silently ignored."""
    p = cfg.parallelism
    _choice("parallelism.context_parallel_impl", p.context_parallel_impl, CONTEXT_PARALLEL_IMPLS)
    if p.context_parallel_degree > 1 and p.pipeline_parallel_degree > 1 and p.context_parallel_impl == "torch":
        raise ConfigError(
            "parallelism.context_parallel_impl",
            "torch",
            "torch's ring attention does not combine with pipeline parallelism here; "
            "use parallelism.context_parallel_impl=allgather (or set a degree to 1)",
        )
    if p.enable_async_tensor_parallel:
        if p.tensor_parallel_degree == 1:
            raise ConfigError(
                "parallelism.enable_async_tensor_parallel", True, "needs parallelism.tensor_parallel_degree > 1"
            )
        if not cfg.compile.enable:
            raise ConfigError(
                "parallelism.enable_async_tensor_parallel", True, "needs compile.enable=true (it is an inductor pass)"
            )
    _choice("parallelism.fsdp_reshard_after_forward", p.fsdp_reshard_after_forward, ("default", "always", "never"))


def check_batch(cfg: JobConfig) -> None:
    """local_batch_size positive; global_batch_size -1 or a multiple of what one microstep takes."""
    t, p = cfg.training, cfg.parallelism
    _positive("training.local_batch_size", t.local_batch_size)
    if t.global_batch_size == -1:
        return
    dp = p.data_parallel_replicate_degree * p.data_parallel_shard_degree
    per_microstep = t.local_batch_size * dp
    if p.pipeline_parallel_degree > 1 and t.global_batch_size != per_microstep:
        raise ConfigError(
            "training.global_batch_size",
            t.global_batch_size,
            "gradient accumulation and pipeline parallelism do not combine yet; "
            "raise local_batch_size (more microbatches) instead",
        )
    if t.global_batch_size <= 0 or t.global_batch_size % per_microstep:
        raise ConfigError(
            "training.global_batch_size",
            t.global_batch_size,
            f"must be a positive multiple of local_batch_size × data-parallel degree = {t.local_batch_size} × {dp} "
            f"(or -1 for exactly that)",
        )


def check_training(cfg: JobConfig) -> None:
    t, m = cfg.training, cfg.model
    _positive("training.steps", t.steps)
    _positive("training.seq_len", t.seq_len)
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            "training.seq_len", t.seq_len, f"exceeds model max_seq_len={m.max_seq_len} of {m.name}_{m.flavor}; lower it"
        )
    _choice("training.mixed_precision_param", t.mixed_precision_param, DTYPES)
    _choice("training.mixed_precision_reduce", t.mixed_precision_reduce, DTYPES)
    _positive("metrics.log_freq", cfg.metrics.log_freq)
    o = cfg.optimizer
    _choice("optimizer.name", o.name, ("AdamW",))
    _choice("optimizer.implementation", o.implementation, ("foreach", "fused", "for-loop"))
    _positive("optimizer.lr", o.lr)
    _positive("optimizer.eps", o.eps)
    for key in ("beta1", "beta2"):
        _in_range(f"optimizer.{key}", getattr(o, key), 0.0, 1.0)
    _in_range("optimizer.weight_decay", o.weight_decay, 0.0, math.inf)
    if math.isnan(t.max_norm) or math.isinf(t.max_norm):
        raise ConfigError("training.max_norm", t.max_norm, "must be a finite number (<= 0 turns clipping off)")
    s = cfg.lr_scheduler
    if s.warmup_steps < 0:
        raise ConfigError("lr_scheduler.warmup_steps", s.warmup_steps, "must be >= 0")
    _choice("lr_scheduler.decay_type", s.decay_type, ("linear", "sqrt", "cosine"))
    for key in ("decay_ratio", "min_lr_factor"):
        _in_range(f"lr_scheduler.{key}", getattr(s, key), 0.0, 1.0)
    ac = cfg.activation_checkpoint
    _choice("activation_checkpoint.mode", ac.mode, ("none", "full", "selective"))
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        if not ac.selective_ac_option.isdigit() or int(ac.selective_ac_option) < 1:
            raise ConfigError(
                "activation_checkpoint.selective_ac_option",
                ac.selective_ac_option,
                "use 'op' or a positive integer N (every N-th block)",
            )


def check_data(cfg: JobConfig) -> None:
    d, m = cfg.data, cfg.model
    _choice("data.source", d.source, ("text", "synthetic"))
    _writable_folder("data.cache_dir", d.cache_dir)  # tokenized corpora, the measured CPU peak FLOP/s
    vocab_key = "data.tokenizer_vocab_size" if d.source == "text" else "data.synthetic_vocab_size"
    vocab = d.tokenizer_vocab_size if d.source == "text" else d.synthetic_vocab_size
    if not 0 < vocab <= m.vocab_size:
        raise ConfigError(vocab_key, vocab, f"must lie in [1, model vocab_size={m.vocab_size}]")
    if d.source == "text" and d.corpus_path is not None and not Path(d.corpus_path).is_file():
        raise ConfigError(
            "data.corpus_path", d.corpus_path, "no such file; point it at a UTF-8 text file or set it to null"
        )
    if d.source == "text" and vocab < 258:
        raise ConfigError(vocab_key, vocab, "a byte-level BPE needs at least 258 ids (256 bytes + 2 special tokens)")
    if d.source == "synthetic" and not 0 < d.synthetic_branching <= d.synthetic_vocab_size:
        raise ConfigError(
            "data.synthetic_branching", d.synthetic_branching, "must lie in [1, data.synthetic_vocab_size]"
        )


COMM_MODES = ("real", "fake_backend", "local_tensor")


def check_comm_mode(mode: str) -> None:
    _choice("debug.comm_mode (or COMM_MODE)", mode, COMM_MODES)


# Keys that only launcher=slurm reads.
SLURM_KEYS = (
    "gpus_per_node", "cpus_per_task", "mem_gb", "partition", "account", "qos", "constraint", "signal_delay_s",
    "max_num_timeout", "setup", "srun_args", "additional_parameters", "submit", "wait", "array_parallelism",
)  # fmt: skip


def check_launcher(launcher: LauncherConfig, started_by: str | None, dry_run: bool = False) -> None:
    """The launcher's own keys; `started_by`: torchrun or srun when this process is one rank of a
    job they started, None when titan_exp places the ranks (or, with `dry_run`, places nothing)."""
    _choice("launcher.name", launcher.name, ("local", "slurm"))
    _choice("launcher.device", launcher.device, ("auto", "cpu", "cuda"))
    if launcher.nproc_per_node == 0 or launcher.nproc_per_node < -1:
        raise ConfigError("launcher.nproc_per_node", launcher.nproc_per_node, "must be a positive count or -1 (auto)")
    _positive("launcher.timeout_min", launcher.timeout_min)
    if launcher.max_parallel == 0 or launcher.max_parallel < -1:
        raise ConfigError(
            "launcher.max_parallel", launcher.max_parallel, "must be a positive count or -1 (as many as fit)"
        )
    if launcher.name == "slurm":
        check_slurm(launcher, None if dry_run else started_by)
        return
    defaults = LauncherConfig()
    for key in SLURM_KEYS:
        if getattr(launcher, key) != getattr(defaults, key):
            raise ConfigError(
                f"launcher.{key}", getattr(launcher, key), "is read by launcher=slurm only; add launcher=slurm"
            )
    if started_by is None and not dry_run and launcher.nodes != 1:
        raise ConfigError(
            "launcher.nodes", launcher.nodes, "launcher=local runs on this machine only; set launcher.nodes=1"
        )


def check_slurm(launcher: LauncherConfig, started_by: str | None) -> None:
    if started_by:
        raise ConfigError(
            "launcher",
            "slurm",
            f"submits a Slurm job of its own, but this process is already one rank of a {started_by} job; "
            "drop launcher=slurm there (or submit from outside the job step)",
        )
    _positive("launcher.nodes", launcher.nodes)
    if not 0 <= launcher.signal_delay_s < 60 * launcher.timeout_min:
        raise ConfigError(
            "launcher.signal_delay_s",
            launcher.signal_delay_s,
            f"must lie in [0, launcher.timeout_min × 60 = {60 * launcher.timeout_min}) seconds: "
            "the warning comes that long before the time limit",
        )
    if launcher.max_num_timeout < 0:
        raise ConfigError("launcher.max_num_timeout", launcher.max_num_timeout, "must be >= 0")
    _positive("launcher.array_parallelism", launcher.array_parallelism)
    if launcher.gpus_per_node < -1:
        raise ConfigError("launcher.gpus_per_node", launcher.gpus_per_node, "must be >= 0 or -1 (one per rank)")
    for key in ("cpus_per_task", "mem_gb"):
        if getattr(launcher, key) is not None:
            _positive(f"launcher.{key}", getattr(launcher, key))


def check_slurm_ranks(launcher: LauncherConfig, degrees_product: int | None) -> None:
    """launcher=slurm with nproc_per_node=-1 needs GPUs per node, or degrees that say how many ranks;
    and a cuda job one GPU per rank on each node."""
    if launcher.nproc_per_node == -1 and launcher.gpus_per_node <= 0:
        if degrees_product is None:
            raise ConfigError(
                "launcher.nproc_per_node",
                -1,
                "launcher=slurm cannot count a node's devices from here; set launcher.nproc_per_node "
                "(or launcher.gpus_per_node, or every parallel degree)",
            )
        if degrees_product % launcher.nodes:
            raise ConfigError(
                "launcher.nodes",
                launcher.nodes,
                f"does not divide the degrees' product {degrees_product}; set launcher.nproc_per_node",
            )
    if launcher.device == "cpu" and launcher.gpus_per_node > 0:
        raise ConfigError(
            "launcher.gpus_per_node", launcher.gpus_per_node, "launcher.device=cpu takes no GPUs; set it to 0"
        )
    gpus, nproc = launcher.gpus_per_node, launcher.nproc_per_node
    if launcher.device != "cpu" and gpus > 0 and nproc > gpus:
        raise ConfigError(
            "launcher.nproc_per_node", nproc, f"exceeds launcher.gpus_per_node={gpus}: each rank needs its own GPU"
        )


def check_gpus(launcher: LauncherConfig, nproc_per_node: int, visible_gpus: int, spawned_here: bool) -> None:
    """launcher.device=cuda needs a GPU, and our launcher one GPU per rank."""
    if launcher.device == "cuda" and visible_gpus == 0:
        raise ConfigError(
            "launcher.device", "cuda", "no GPU is visible on this machine; use launcher.device=cpu or auto"
        )
    if spawned_here and launcher.device != "cpu" and visible_gpus and nproc_per_node > visible_gpus:
        raise ConfigError(
            "launcher.nproc_per_node",
            nproc_per_node,
            f"only {visible_gpus} GPU(s) visible; lower it or use launcher.device=cpu",
        )


def check_cpu_ranks(launcher: LauncherConfig, nproc_per_node: int, cores: int) -> None:
    """CPU ranks that our launcher starts here get a core each, unless oversubscribing is asked for:
    more ranks than cores time-share them, and every speed figure of the run is then meaningless."""
    if nproc_per_node > cores and not launcher.oversubscribe:
        raise ConfigError(
            "launcher.nproc_per_node",
            nproc_per_node,
            f"more CPU ranks than the {cores} core(s) this process may use; lower it, "
            "or add launcher.oversubscribe=true to time-share the cores (fine for parity checks, not for speed)",
        )


def check_memory_fit(cfg: JobConfig, estimate: Callable[[JobConfig], RankMemory], budget: int, where: str) -> None:
    """One rank's estimated peak (estimate/memory.py) within the `budget` bytes each rank can have
    (`where` says what that budget is). A refusal names the fixes that the same estimate says fit."""
    needed = estimate(cfg)
    if needed.total <= budget:
        return
    fixes = []
    for options in _memory_fixes(cfg):
        fitting = (fix for fix, changed in options if estimate(changed).total <= budget)
        fixes += [fix] if (fix := next(fitting, None)) else []
    fixes.append(_rank_count_fix(cfg, needed))
    m = cfg.model
    raise ConfigError(
        "model",
        f"{m.name}_{m.flavor}",
        f"one rank needs about {needed.total / GIB:.1f} GiB ({needed.describe()}) but each can have "
        f"{budget / GIB:.1f} GiB ({where}); try {' or '.join(fixes)}",
    )


def _rank_count_fix(cfg: JobConfig, needed: RankMemory) -> str:
    """More ranks help where sharded training state dominates; fewer where each process's own
    footprint does."""
    if needed.parameters + needed.gradients + needed.optimizer_state >= needed.total / 2:
        return "more ranks to shard over" if cfg.parallelism.data_parallel_shard_degree > 1 else "an FSDP layout"
    return "fewer ranks (launcher.nproc_per_node)"


def _memory_fixes(cfg: JobConfig) -> list[Iterator[tuple[str, JobConfig]]]:
    """Kinds of change that lower one rank's memory, each as its options mildest first (the override
    and the changed config): full activation checkpointing, smaller local batches (whole pipeline
    microbatches), fewer layers."""
    mb = cfg.parallelism.pipeline_parallel_microbatch_size if cfg.parallelism.pipeline_parallel_degree > 1 else 1
    batches = [b for b in range(cfg.training.local_batch_size - 1, 0, -1) if b % mb == 0]
    full_ac = [_changed(cfg, "activation_checkpoint.mode", "full")] if cfg.activation_checkpoint.mode != "full" else []
    return [
        iter(full_ac),
        (_changed(cfg, "training.local_batch_size", b) for b in batches),
        (_changed(cfg, "model.n_layers", n) for n in range(cfg.model.n_layers - 1, 0, -1)),
    ]


def _changed(cfg: JobConfig, key: str, value: object) -> tuple[str, JobConfig]:
    changed = copy.deepcopy(cfg)
    section, name = key.split(".")
    setattr(getattr(changed, section), name, value)
    return f"{key}={value}", changed


def check_cuda_only_features(cfg: JobConfig) -> None:
    """Features that exist on CUDA only, refused on a CPU job by name (cfg.launcher.device resolved)."""
    if cfg.launcher.device == "cuda":
        return
    p = cfg.parallelism
    if p.context_parallel_degree > 1 and p.context_parallel_impl == "torch":
        raise ConfigError(
            "parallelism.context_parallel_impl",
            "torch",
            "torch's ring attention needs CUDA (the CPU attention kernel has no context-parallel sharding "
            "strategy); use parallelism.context_parallel_impl=allgather (or auto) on CPU",
        )
    if cfg.quantize.name == "mxfp8":
        raise ConfigError(
            "quantize",
            "mxfp8",
            "needs a Blackwell (compute capability >= 10.0) GPU; use quantize=float8 on this machine",
        )
    if p.enable_async_tensor_parallel:
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel", True, "needs CUDA (symmetric memory); set it to false on CPU"
        )


def check_dry_run_world(launcher: LauncherConfig) -> None:
    """A dry run places nothing, so the world must be spelled out."""
    if launcher.nproc_per_node == -1:
        raise ConfigError(
            "launcher.nproc_per_node",
            -1,
            "a dry run needs the world spelled out: set launcher.nproc_per_node (and launcher.nodes)",
        )


def check_local_tensor_layout(cfg: JobConfig) -> None:
    """COMM_MODE=local_tensor runs tensor parallelism only (degrees resolved)."""
    p = cfg.parallelism
    others = (
        p.data_parallel_shard_degree,
        p.data_parallel_replicate_degree,
        p.pipeline_parallel_degree,
        p.context_parallel_degree,
    )
    if max(others) > 1:
        raise ConfigError(
            "COMM_MODE",
            "local_tensor",
            "runs tensor parallelism only: torch 2.13's LocalTensorMode fails inside FSDP2 (resize_() on an invalid "
            "storage) and is not wired for DDP/pipelining/CP here; "
            f"use parallelism=tp, or COMM_MODE=fake_backend for {p.name}",
        )


def check_quantize(cfg: JobConfig) -> None:
    q = cfg.quantize
    _choice("quantize", q.name, ("none", "float8", "mxfp8"))
    if q.name == "float8":
        _choice("quantize.recipe", q.recipe, ("tensorwise", "rowwise"))
    if q.enable_fsdp_float8_all_gather and (q.name != "float8" or q.recipe != "tensorwise"):
        raise ConfigError(
            "quantize.enable_fsdp_float8_all_gather",
            True,
            "works with quantize=float8 and quantize.recipe=tensorwise only",
        )
    if q.name == "mxfp8" and cfg.parallelism.tensor_parallel_degree > 1:
        raise ConfigError(
            "quantize",
            q.name,
            "mxfp8 under tensor parallelism is not wired here; use quantize=float8 or tensor_parallel_degree=1",
        )


def check_checkpoint(cfg: JobConfig, world_size: int) -> None:
    c = cfg.checkpoint
    if c.create_seed_checkpoint and world_size != 1:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint",
            True,
            f"writes the initial weights from one rank but the world size is {world_size}; add parallelism=single",
        )
    _positive("checkpoint.interval", c.interval)
    if c.enable or c.create_seed_checkpoint:
        _writable_folder("checkpoint.folder", c.folder)
    resumes_at = latest_step(c.folder) if c.enable else None
    if resumes_at is not None and resumes_at >= cfg.training.steps:
        raise ConfigError(
            "training.steps",
            cfg.training.steps,
            f"checkpoint.folder={c.folder} holds step-{resumes_at} already, so nothing is left to train; "
            "raise training.steps or point checkpoint.folder elsewhere",
        )
    if c.keep_latest_k < 0:
        raise ConfigError("checkpoint.keep_latest_k", c.keep_latest_k, "must be >= 0 (0 keeps every checkpoint)")
    if c.initial_load_path is not None and not (Path(c.initial_load_path) / ".metadata").is_file():
        raise ConfigError(
            "checkpoint.initial_load_path",
            c.initial_load_path,
            "not a checkpoint folder (no .metadata); point it at a step-N folder, e.g. a seed checkpoint's step-0",
        )


# How long a tracking server has to answer its health endpoint before the job is refused.
_SERVER_ANSWER_S = 3.0
_STORE_FORMS = "sqlite:///path/to/mlflow.db or http(s)://host:port of an MLflow server (or tracking=none)"


def check_tracking(t: TrackingConfig) -> None:
    """A store the job can write, found before any rank starts (a job that trains to the end and
    records nothing costs its whole run): a SQLite file that is a database, in a folder that can
    be written, or a server that answers."""
    if not t.enable:
        return
    if not t.experiment:
        raise ConfigError("tracking.experiment", "''", "must name an MLflow experiment, e.g. titan_exp")
    _positive("tracking.close_timeout_s", t.close_timeout_s)
    if not t.uri:
        raise ConfigError("tracking.uri", "''", f"must name a store: {_STORE_FORMS}")
    db = sqlite_path(t.uri)
    if db is not None:
        _sqlite_store(t.uri, db)
    elif t.uri.startswith(("http://", "https://")):
        _answering_server(t.uri)
    else:
        raise ConfigError("tracking.uri", t.uri, f"unsupported store; use {_STORE_FORMS}")


def _sqlite_store(uri: str, db: Path) -> None:
    _writable_folder("tracking.uri", str(db.parent), uri)
    if not db.exists():
        return
    try:  # reads the schema only: cheap on any size of store
        with contextlib.closing(sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True, timeout=5)) as store:
            store.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.Error as err:
        if is_store_busy(err):  # another job is writing it: a database
            return
        raise ConfigError(
            "tracking.uri", uri, f"{db} is not a readable SQLite database ({err}); move it away or name another file"
        ) from None


def _answering_server(uri: str) -> None:
    if down := server_answers(uri, _SERVER_ANSWER_S):
        raise ConfigError(
            "tracking.uri",
            uri,
            f"{down}; start one (mlflow server --backend-store-uri sqlite:///mlflow.db --port PORT) "
            "or use a sqlite:/// store",
        )


def check_profiling(cfg: JobConfig) -> None:
    p = cfg.profiling
    _choice("profiling", p.name, ("none", "trace", "memory", "full"))
    if p.enable_profiling:
        _positive("profiling.profiler_active", p.profiler_active)
        if p.profiler_warmup < 0:
            raise ConfigError("profiling.profiler_warmup", p.profiler_warmup, "must be >= 0")
        if p.profile_freq < p.profiler_warmup + p.profiler_active:
            raise ConfigError(
                "profiling.profile_freq",
                p.profile_freq,
                f"must be >= profiling.profiler_warmup + profiling.profiler_active = "
                f"{p.profiler_warmup + p.profiler_active} (the steps each period warms up and records)",
            )
        if not p.save_traces_folder:
            raise ConfigError("profiling.save_traces_folder", "''", "must name a folder (relative to the job's)")
    if p.enable_memory_snapshot:
        _positive("profiling.memory_snapshot_freq", p.memory_snapshot_freq)
        if not p.save_memory_snapshot_folder:
            raise ConfigError(
                "profiling.save_memory_snapshot_folder", "''", "must name a folder (relative to the job's)"
            )


def check_job(cfg: JobConfig) -> None:
    """Every rule that needs only the config, its degrees resolved (see config/resolve.py)."""
    check_training(cfg)
    check_model_fit(cfg)
    check_supported_layout(cfg)
    check_batch(cfg)
    check_data(cfg)
    check_checkpoint(cfg, cfg.launcher.world_size)
    check_quantize(cfg)
    check_profiling(cfg)
    check_tracking(cfg.tracking)

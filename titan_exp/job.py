"""The launching side of one training job: resolve the config, prepare the store, place the ranks,
and record the outcome of a job whose ranks died. Ranks receive only the resolved config."""

import contextlib
import dataclasses
import os
from pathlib import Path

from launchers import env as rank_env
from launchers.local import cpu_threads_per_rank, launch_local
from launchers.placement import Placement, plan, visible_gpus
from titan_exp.config.check import ConfigError, resolve
from titan_exp.config.schema import JobConfig, RunContext
from titan_exp.tracking.rank0 import tracked_run


def comm_mode(cfg: JobConfig) -> str:
    return os.environ.get("COMM_MODE") or cfg.debug.comm_mode


def prepare(cfg: JobConfig) -> tuple[JobConfig, Placement]:
    """Check the config and fill in everything inferred; raises ConfigError before anything starts."""
    mode = comm_mode(cfg)
    if mode not in ("real", "fake_backend", "local_tensor"):
        raise ConfigError("debug.comm_mode (or COMM_MODE)", mode, "choose real, fake_backend or local_tensor")
    if mode != "real":
        return _prepare_dry_run(cfg, mode)
    placement = plan(cfg.launcher, cfg.parallelism)
    cfg = resolve(cfg, placement.world_size)
    if not placement.external and uses_gpus(cfg) and placement.nproc_per_node > visible_gpus():
        raise ConfigError(
            "launcher.nproc_per_node", placement.nproc_per_node,
            f"only {visible_gpus()} GPU(s) visible; lower it or use launcher.device=cpu",
        )
    if cfg.parallelism.context_parallel_degree > 1 and not uses_gpus(cfg):
        raise ConfigError(
            "parallelism.context_parallel_degree", cfg.parallelism.context_parallel_degree,
            "context parallelism needs CUDA: torch has no context-parallel attention for CPU "
            "(aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy); set it to 1",
        )
    if cfg.quantize.name == "mxfp8" and not uses_gpus(cfg):
        raise ConfigError("quantize", "mxfp8", "needs a Blackwell (compute capability >= 10.0) GPU; use quantize=float8 on this machine")
    if cfg.parallelism.enable_async_tensor_parallel and not uses_gpus(cfg):
        raise ConfigError("parallelism.enable_async_tensor_parallel", True, "needs CUDA (symmetric memory); set it to false on CPU")
    # Ranks may start in another directory: hand them absolute paths.
    data = dataclasses.replace(cfg.data, cache_dir=str(Path(cfg.data.cache_dir).resolve()))
    checkpoint = dataclasses.replace(
        cfg.checkpoint,
        folder=str(Path(cfg.checkpoint.folder).resolve()),
        initial_load_path=cfg.checkpoint.initial_load_path and str(Path(cfg.checkpoint.initial_load_path).resolve()),
    )
    tracking = cfg.tracking
    if tracking.enable:
        from titan_exp.tracking.mlflow_run import absolute_uri

        tracking = dataclasses.replace(tracking, uri=absolute_uri(tracking.uri))
    return dataclasses.replace(cfg, data=data, checkpoint=checkpoint, tracking=tracking), placement


def _prepare_dry_run(cfg: JobConfig, mode: str) -> tuple[JobConfig, Placement]:
    """A dry run places nothing: the world is launcher.nproc_per_node × launcher.nodes, as given."""
    if cfg.launcher.nproc_per_node == -1:
        raise ConfigError("launcher.nproc_per_node", -1, "a dry run needs the world spelled out: set launcher.nproc_per_node (and launcher.nodes)")
    world_size = cfg.launcher.nproc_per_node * cfg.launcher.nodes
    single_node = dataclasses.replace(cfg.launcher, nodes=1, device="cpu")
    cfg = resolve(dataclasses.replace(cfg, launcher=single_node), world_size)
    p = cfg.parallelism
    if mode == "local_tensor" and (p.data_parallel_shard_degree > 1 or p.data_parallel_replicate_degree > 1 or p.pipeline_parallel_degree > 1 or p.context_parallel_degree > 1):
        raise ConfigError(
            "COMM_MODE", "local_tensor",
            f"runs tensor parallelism only: torch 2.13's LocalTensorMode fails inside FSDP2 (resize_() on an invalid storage) "
            f"and is not wired for DDP/pipelining/CP here; use parallelism=tp, or COMM_MODE=fake_backend for {p.name}",
        )
    return cfg, Placement(world_size, cfg.launcher.nproc_per_node, None, 0)


def uses_gpus(cfg: JobConfig) -> bool:
    if cfg.launcher.device == "cuda" and visible_gpus() == 0:
        raise ConfigError("launcher.device", "cuda", "no GPU is visible on this machine; use launcher.device=cpu or auto")
    return cfg.launcher.device == "cuda" or (cfg.launcher.device == "auto" and visible_gpus() > 0)


def device_kind(cfg: JobConfig) -> str:
    return "cuda" if uses_gpus(cfg) else "cpu"


def _train_entry(args: tuple[JobConfig, RunContext]) -> dict[str, float]:
    """A rank's body. Rank 0 of a tracked job starts its MLflow writer first, before torch is
    imported here (the launching process never loads torch)."""
    cfg, ctx = args
    env = rank_env.current()
    tracking = env.rank == 0 and cfg.tracking.enable
    with tracked_run(cfg, ctx, env.world_size, device_kind(cfg)) if tracking else contextlib.nullcontext() as tracker:
        from titan_exp.train.trainer import train

        return train(cfg, tracker)


def run_job(cfg: JobConfig, placement: Placement, job_dir: Path) -> dict[str, float]:
    """Train with `cfg` (already prepared); returns rank 0's last metrics.

    The MLflow run's status says how the job ended: FINISHED, FAILED (with a failure_reason tag)
    or KILLED (interrupted).
    """
    if comm_mode(cfg) == "fake_backend":
        from titan_exp.dryrun import fake_backend_dry_run
        from titan_exp.metrics.logger import format_summary

        report = fake_backend_dry_run(cfg, placement.world_size)
        print(f"dry run (fake_backend), rank 0 of {placement.world_size}: {format_summary(report)}", flush=True)
        return report
    if comm_mode(cfg) == "local_tensor":
        from titan_exp.dryrun import local_tensor_run

        losses = local_tensor_run(cfg, placement.world_size)
        if any(max(step) - min(step) > 1e-6 * abs(step[0]) for step in losses):
            raise RuntimeError("ranks disagree on the loss under local_tensor: the layout is not replicating it")
        return {"loss/global_avg": losses[-1][0]}
    ctx = RunContext(job_dir=str(job_dir), launcher=placement.external or cfg.launcher.name)
    if placement.external:
        return _train_entry((cfg, ctx))  # this process is one rank already
    if cfg.tracking.enable:
        from titan_exp.tracking.mlflow_run import ensure_store

        ensure_store(cfg.tracking)
    try:
        return launch_local(
            _train_entry,
            (cfg, ctx),
            placement.nproc_per_node,
            job_dir / "ranks",
            use_gpus=uses_gpus(cfg),
            timeout_min=cfg.launcher.timeout_min,
            threads_per_rank=cpu_threads_per_rank(cfg.launcher.cpu_threads_per_rank, placement.nproc_per_node),
        )
    except BaseException as err:
        if cfg.tracking.enable:
            _record_failure(cfg, ctx, placement, err)
        raise


def _record_failure(cfg: JobConfig, ctx: RunContext, placement: Placement, err: BaseException) -> None:
    from titan_exp.tracking.identity import run_name, run_tags
    from titan_exp.tracking.mlflow_run import close_run_from_outside

    tags = run_tags(cfg, placement.world_size, ctx.launcher, device_kind(cfg))
    close_run_from_outside(cfg.tracking, ctx.run_id_file, run_name(cfg), tags, err)

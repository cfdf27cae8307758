"""The launching side of one training job: resolve the config, open its tracking run, place the
ranks, and close the run with the outcome. Ranks receive only the resolved config."""

import dataclasses
import os
from pathlib import Path

from omegaconf import OmegaConf

from launchers.local import cpu_threads_per_rank, launch_local
from launchers.placement import Placement, plan, visible_gpus
from titan_exp.config.check import ConfigError, resolve
from titan_exp.config.schema import JobConfig
from titan_exp.parallel.dims import ParallelDims
from titan_exp.train.trainer import train


def prepare(cfg: JobConfig) -> tuple[JobConfig, Placement]:
    """Check the config and fill in everything inferred; raises ConfigError before anything starts."""
    placement = plan(cfg.launcher, cfg.parallelism)
    cfg = resolve(cfg, placement.world_size)
    if not placement.external and _uses_gpus(cfg) and placement.nproc_per_node > visible_gpus():
        raise ConfigError(
            "launcher.nproc_per_node", placement.nproc_per_node,
            f"only {visible_gpus()} GPU(s) visible; lower it or use launcher.device=cpu",
        )
    # Ranks may start in another directory: hand them absolute paths.
    data = dataclasses.replace(cfg.data, cache_dir=str(Path(cfg.data.cache_dir).resolve()))
    tracking = cfg.tracking
    if tracking.enable:
        from titan_exp.tracking.mlflow_run import absolute_uri

        tracking = dataclasses.replace(tracking, uri=absolute_uri(tracking.uri))
    return dataclasses.replace(cfg, data=data, tracking=tracking), placement


def _uses_gpus(cfg: JobConfig) -> bool:
    if cfg.launcher.device == "cuda" and visible_gpus() == 0:
        raise ConfigError("launcher.device", "cuda", "no GPU is visible on this machine; use launcher.device=cpu or auto")
    return cfg.launcher.device == "cuda" or (cfg.launcher.device == "auto" and visible_gpus() > 0)


def run_name(cfg: JobConfig) -> str:
    return cfg.tracking.run_name or f"{cfg.model.name}_{cfg.model.flavor}·{ParallelDims.from_config(cfg.parallelism).label()}"


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def open_run(cfg: JobConfig, placement: Placement, overrides: list[str]):
    """Create the job's MLflow run with its tags, params and config artifacts; returns the run."""
    from titan_exp.tracking.mlflow_run import MlflowRun

    dims = ParallelDims.from_config(cfg.parallelism)
    tags = {
        "model": f"{cfg.model.name}_{cfg.model.flavor}",
        "strategy": cfg.parallelism.name,
        "layout": dims.label(),
        "world_size": str(placement.world_size),
        "mesh": dims.describe(),
        "device": "cuda" if _uses_gpus(cfg) else "cpu",
        "launcher": placement.external or cfg.launcher.name,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
        "status": "running",
    }
    run = MlflowRun.create(cfg.tracking, run_name(cfg), tags)
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg))
    run.log_params(flatten(resolved))
    run.log_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)), "config/resolved.yaml")
    run.log_text("\n".join(overrides) + "\n", "config/overrides.txt")
    return run


def run_job(cfg: JobConfig, placement: Placement, job_dir: Path, overrides: list[str]) -> dict[str, float]:
    """Train with `cfg` (already prepared); returns rank 0's last metrics. The run's MLflow status
    says how it ended: FINISHED, FAILED (with a failure_reason tag) or KILLED."""
    owns_run = cfg.tracking.enable and placement.rank == 0
    run = open_run(cfg, placement, overrides) if owns_run else None
    if run:
        cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, run_id=run.run_id))
        print(f"MLflow run {run.run_id} ({run_name(cfg)}) in {cfg.tracking.uri}", flush=True)
    try:
        if placement.external:
            result = train(cfg)
        else:
            result = launch_local(
                train,
                cfg,
                placement.nproc_per_node,
                job_dir / "ranks",
                use_gpus=_uses_gpus(cfg),
                timeout_min=cfg.launcher.timeout_min,
                threads_per_rank=cpu_threads_per_rank(cfg.launcher.cpu_threads_per_rank, placement.nproc_per_node),
            )
    except BaseException as err:
        if run:
            run.finish("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", reason=f"{type(err).__name__}: {err}")
        raise
    if run:
        run.finish("FINISHED")
    return result

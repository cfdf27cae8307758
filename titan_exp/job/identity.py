"""How a job is named and tagged in MLflow, so runs can be found and grouped by layout."""

import os

from titan_exp.config.schema import JobConfig
from titan_exp.parallel.dims import ParallelDims


def run_name(cfg: JobConfig) -> str:
    """e.g. llama3_debug·fsdp2, llama3_8b·fsdp8·tp2·float8 (tracking.run_name wins when set)."""
    if cfg.tracking.run_name:
        return cfg.tracking.run_name
    parts = [f"{cfg.model.name}_{cfg.model.flavor}", ParallelDims.from_config(cfg.parallelism).label()]
    if cfg.quantize.name != "none":
        parts.append(cfg.quantize.name)
    return "·".join(parts)


def run_tags(cfg: JobConfig, started_by: str) -> dict[str, str]:
    """Tags of a resolved config's run; `started_by`: local, torchrun or srun."""
    dims = ParallelDims.from_config(cfg.parallelism)
    return {
        "model": f"{cfg.model.name}_{cfg.model.flavor}",
        "strategy": cfg.parallelism.name,
        "quantize": cfg.quantize.name,
        "layout": dims.label(),
        "world_size": str(cfg.launcher.world_size),
        "mesh": dims.describe(),
        "device": cfg.launcher.device,
        "launcher": started_by,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""),
        "status": "running",
        "layout_key": layout_key(cfg),
    }


def layout_key(cfg: JobConfig) -> str:
    """What a prediction and a training run must share to be compared (python -m titan_exp plan):
    the model, the layout, the batch's shape, precision and the memory-saving options."""
    p, t = cfg.parallelism, cfg.training
    parts = [
        f"{cfg.model.name}_{cfg.model.flavor}",
        ParallelDims.from_config(p).label(),
        f"batch{t.local_batch_size}x{t.seq_len}/{t.global_batch_size}",
        t.mixed_precision_param,
        f"ac-{cfg.activation_checkpoint.mode}",
        cfg.quantize.name,
    ]
    if p.pipeline_parallel_degree > 1:
        parts.append(f"{p.pipeline_parallel_schedule}-mb{p.pipeline_parallel_microbatch_size}")
    return "·".join(parts)


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{'a': {'b': 1}} → {'a.b': 1}: the config as MLflow params."""
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat

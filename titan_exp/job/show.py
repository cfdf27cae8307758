"""`titan_exp show [overrides]`: the resolved job, what the ranks will receive: the mesh with every
degree filled in, where the ranks run, the global batch and its accumulation, the dtypes, the model's
size and the device profile, then the whole resolved config. Nothing starts and nothing is written."""

import argparse
import sys

from omegaconf import OmegaConf

from titan_exp.checkpoint.config import OWN_FOLDER, own_folder
from titan_exp.config.check import cautions
from titan_exp.config.compose import compose_job_config
from titan_exp.config.job import ResolvedJob
from titan_exp.estimate.workload import inactive_parameters, model_parameters
from titan_exp.job.outcome import EXIT_BAD_CONFIG, composition_error
from titan_exp.job.resume import resolve_to_run
from titan_exp.models.config import ModelConfig
from titan_exp.parallel.config import MESH_DIMS
from titan_exp.rules import ConfigError


def summary(job: ResolvedJob) -> str:
    cfg, dims, place = job.config, job.dims, job.placement
    t, m = cfg.training, cfg.model
    microbatch = f"{t.local_batch_size} × dp {dims.dp} × {job.accumulation} microbatch(es)"
    where = place.started_by
    threads = f", {place.threads_per_rank} thread(s) per rank" if place.device == "cpu" else ""
    rows = [
        ("run name", job.run_name()),
        (
            "mesh",
            " × ".join(f"{MESH_DIMS[key]} {degree}" for key, degree in dims.degrees().items())
            + f" = world {dims.world_size}: {dims.label()}",
        ),  # fmt: skip
        ("ranks", f"{place.nodes} node(s) × {place.nproc_per_node} on {place.device} ({where}{threads})"),
        ("global batch", f"{t.global_batch_size} sequences = {microbatch}; seq_len {t.seq_len}"),
        ("tokens/step", f"{job.tokens_per_step:,}"),
        (
            "dtypes",
            f"params {t.mixed_precision_param}, gradient reduce {t.mixed_precision_reduce}; "
            f"quantize {cfg.quantize.name}",
        ),  # fmt: skip
        (
            "model",
            f"{job.model_name}: {model_parameters(m):,} parameters, dim {m.dim}, {m.n_layers} layers, "
            f"{m.n_heads} heads ({m.n_kv_heads or m.n_heads} kv)" + _experts(m),
        ),  # fmt: skip
        ("memory saving", f"activation checkpointing {cfg.activation_checkpoint.mode}, compile {cfg.compile.enable}"),
        ("device profile", f"hardware={cfg.hardware.name} (what `titan_exp plan` predicts for)"),
        ("tracking", f"{cfg.tracking.uri}, experiment {cfg.tracking.experiment}" if cfg.tracking.enable else "off"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titan_exp show",
        description="The resolved job for these overrides (what the ranks receive): the summary, then the config.",
    )
    parser.add_argument("overrides", nargs="*", help="GROUP=OPTION and KEY=VALUE, as for a run")
    parser.add_argument("--summary", action="store_true", help="only the summary, not the whole config")
    args = parser.parse_args(argv)
    try:
        cfg = compose_job_config(args.overrides)
        job = resolve_to_run(cfg, None, room=False)  # shown whether or not this machine could run it
    except ConfigError as err:
        print(f"titan_exp: config error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except Exception as err:  # Hydra's: an unknown key or option
        print(f"titan_exp: config error: {composition_error(err)}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(summary(job))
    for line in job.resume.lines if job.resume else ():
        print(line)
    for caution in cautions(cfg, job.dims):
        print(f"caution: {caution}")
    try:
        job.launcher.check_room(job.placement, cfg.launcher.oversubscribe)
    except ConfigError as err:
        print(f"caution: not here as it is: {err}")
    if not args.summary:
        shown = OmegaConf.structured(job.config)
        if job.config.checkpoint.folder == OWN_FOLDER:  # filled in when the job has its folder
            shown.checkpoint.folder = own_folder()
        print("\n# the resolved config\n" + OmegaConf.to_yaml(shown), end="")
    return 0


def _experts(m: ModelConfig) -> str:
    """A MoE model's experts and the parameters a token goes through."""
    if not m.moe.enabled:
        return ""
    active = model_parameters(m) - inactive_parameters(m)
    return f", {m.moe.top_k} of {m.moe.num_experts} experts per token ({active:,} parameters active)"

"""The launching side of one job: run a resolved config (config/resolve.py) as a dry run in this
process, as this process's own rank (under torchrun or srun), or as rank processes placed by our
launcher; prepare the store first and record the outcome of a job whose ranks died. Torch-free:
torch is imported by the ranks (and by the dry runs, which are the job's work)."""

from pathlib import Path

from launchers.env import external_launcher
from launchers.local import launch_local
from titan_exp.config.schema import JobConfig
from titan_exp.job.context import RunContext
from titan_exp.job.identity import run_name, run_tags
from titan_exp.job.rank_entry import run_rank
from titan_exp.metrics.format import format_summary
from titan_exp.tracking.run import close_run_from_outside
from titan_exp.tracking.store import ensure_store


def run_job(cfg: JobConfig, job_dir: Path) -> dict[str, float]:
    """Run a resolved config; returns rank 0's last metrics.

    The MLflow run's status says how the job ended: FINISHED, FAILED (with a failure_reason tag)
    or KILLED (interrupted).
    """
    if cfg.debug.comm_mode != "real":
        return _dry_run(cfg)
    started_by = external_launcher()
    ctx = RunContext(job_dir=str(job_dir), started_by=started_by or cfg.launcher.name)
    if started_by:
        return run_rank((cfg, ctx))  # this process is one rank already
    if cfg.tracking.enable:
        ensure_store(cfg.tracking)
    try:
        return launch_local(
            run_rank,
            (cfg, ctx),
            cfg.launcher.nproc_per_node,
            job_dir / "ranks",
            use_gpus=cfg.launcher.device == "cuda",
            timeout_min=cfg.launcher.timeout_min,
            threads_per_rank=cfg.launcher.cpu_threads_per_rank,
        )
    except BaseException as err:
        if cfg.tracking.enable:
            close_run_from_outside(cfg.tracking, ctx.run_id_file, run_name(cfg), run_tags(cfg, ctx.started_by), err)
        raise


def _dry_run(cfg: JobConfig) -> dict[str, float]:
    """COMM_MODE=fake_backend or local_tensor, in this process (train/dry_run.py)."""
    from titan_exp.train import dry_run  # torch: the dry run is this process's work

    world_size = cfg.launcher.world_size
    if cfg.debug.comm_mode == "fake_backend":
        report = dry_run.fake_backend_dry_run(cfg, world_size)
        print(f"dry run (fake_backend), rank 0 of {world_size}: {format_summary(report)}", flush=True)
        return report
    losses = dry_run.local_tensor_run(cfg, world_size)
    if any(max(step) - min(step) > 1e-6 * abs(step[0]) for step in losses):
        raise RuntimeError("ranks disagree on the loss under local_tensor: the layout is not replicating it")
    return {"loss/global_avg": losses[-1][0]}

"""The launching side of one job: run a resolved config (config/resolve.py) as a dry run in this
process, as this process's own rank (under torchrun or srun), as rank processes placed by our local
launcher, or as a Slurm job we submit and follow; prepare the store first and record the outcome of
a job whose ranks died. Torch-free:
torch is imported by the ranks (and by the dry runs, which are the job's work)."""

from pathlib import Path

from launchers import slurm
from launchers.env import external_launcher
from launchers.local import launch_local
from titan_exp.config.schema import JobConfig
from titan_exp.job.context import RunContext
from titan_exp.job.identity import run_name, run_tags
from titan_exp.job.rank_entry import TRACKING_INCOMPLETE, run_rank
from titan_exp.job.tracked_run import left_in_journal
from titan_exp.metrics import startup
from titan_exp.metrics.format import format_summary
from titan_exp.tracking.journal import close_run_from_outside
from titan_exp.tracking.store import ensure_store


def run_job(cfg: JobConfig, job_dir: Path) -> dict[str, float]:
    """Run a resolved config; returns rank 0's last metrics.

    The MLflow run's status says how the job ended: FINISHED, FAILED (with a failure_reason tag)
    or KILLED (interrupted).
    """
    if cfg.debug.comm_mode != "real":
        return _dry_run(cfg)
    if cfg.launcher.name == "slurm":
        return _run_on_slurm(cfg, job_dir)
    started_by = external_launcher()
    if started_by:  # this process is one rank already
        return _tracking_complete(run_rank((cfg, RunContext(job_dir=str(job_dir), started_by=started_by))))
    if cfg.tracking.enable:
        ensure_store(cfg.tracking)
    startup.mark("store")
    ctx = RunContext(job_dir=str(job_dir), started_by=cfg.launcher.name, startup=startup.carried())
    try:
        result = launch_local(
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
            _close_run_from_outside(cfg, ctx, err)
        raise
    return _tracking_complete(result)


class TrackingIncomplete(RuntimeError):
    """Training finished, but the store did not take all of its records (they are in the journal)."""


def _tracking_complete(result: dict[str, object]) -> dict[str, object]:
    """Rank 0's result, or TrackingIncomplete when the store did not take all of the run."""
    if TRACKING_INCOMPLETE in result:
        raise TrackingIncomplete(f"training finished, but {result[TRACKING_INCOMPLETE]}")
    return result


def _close_run_from_outside(cfg: JobConfig, ctx: RunContext, err: BaseException) -> None:
    """The ranks died of `err`: what rank 0 journaled and its log go into the run, which ends with
    the status `err` implies (a store that is down leaves that for `sync`, and says so)."""
    try:
        close_run_from_outside(cfg.tracking, Path(ctx.job_dir), run_name(cfg), run_tags(cfg, ctx.started_by), err)
    except Exception as store_err:
        err.add_note(left_in_journal(ctx, f"{type(store_err).__name__}: {store_err}"))


class StoppedBySlurm(RuntimeError):
    """The Slurm job stopped early for good (time limit or preemption, nothing to resume from)."""

    interrupted = True  # its run ends KILLED


def slurm_job_spec(cfg: JobConfig) -> slurm.SlurmJobSpec:
    """What a resolved config asks Slurm for."""
    launcher = cfg.launcher
    return slurm.SlurmJobSpec(
        job_name="titan_exp:" + run_name(cfg).replace("·", "-"),
        nodes=launcher.nodes,
        tasks_per_node=launcher.nproc_per_node,
        timeout_min=launcher.timeout_min,
        gpus_per_node=launcher.gpus_per_node,
        cpus_per_task=launcher.cpus_per_task,
        mem_gb=launcher.mem_gb,
        partition=launcher.partition,
        account=launcher.account,
        qos=launcher.qos,
        constraint=launcher.constraint,
        signal_delay_s=launcher.signal_delay_s,
        setup=tuple(launcher.setup),
        srun_args=tuple(launcher.srun_args),
        additional_parameters=dict(launcher.additional_parameters),
        threads_per_task=launcher.cpu_threads_per_rank,
    )


def _run_on_slurm(cfg: JobConfig, job_dir: Path) -> dict[str, float]:
    """Submit the job (or only print its batch script: launcher.submit=false), then follow it to
    its end unless launcher.wait=false."""
    spec, folder = slurm_job_spec(cfg), job_dir / "slurm"
    if not cfg.launcher.submit:
        print(slurm.batch_script(spec, folder), end="", flush=True)
        return {}
    if cfg.tracking.enable:
        ensure_store(cfg.tracking)
    ctx = RunContext(job_dir=str(job_dir), started_by="slurm")
    job = slurm.submit(run_rank, (cfg, ctx), spec, folder)
    logs = job.folder / f"{job.job_id}_<rank>_log.out"
    print(f"Slurm job {job.job_id} submitted: {spec.nodes * spec.tasks_per_node} ranks, logs {logs}", flush=True)
    if not cfg.launcher.wait:
        return {}
    try:
        result = slurm.wait(job, lambda line: print(line, flush=True))
        if "stopped" in result:
            raise StoppedBySlurm(result["stopped"])
    except BaseException as err:
        if cfg.tracking.enable:
            _close_run_from_outside(cfg, ctx, err)
        raise
    return _tracking_complete(result)


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

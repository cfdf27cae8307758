"""A Hydra multirun as one MLflow parent run, with each point's run as its child.

Hydra calls `SweepParentRun` in the process that starts the sweep: it creates the store and the
parent run before any point starts and leaves the parent's id in the sweep directory, where every
point finds it, also a point that runs as a separate job (another process, a Slurm job) on a shared
file system. When the sweep is over it writes the strategy comparison into the parent run and ends it.
"""

import dataclasses
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from titan_exp.config.schema import JobConfig
from titan_exp.tracking.config import TrackingConfig

PARENT_RUN_FILE = "mlflow_parent_run_id"
_MAX_RUN_NAME = 250

# The sweep this process started, if any: main() ends it as KILLED when the user interrupts.
_active: "SweepParentRun | None" = None


def join_sweep(cfg: JobConfig, sweep_dir: Path) -> JobConfig:
    """The point's config, its run a child of the sweep's parent run (if the sweep has one)."""
    parent_file = sweep_dir / PARENT_RUN_FILE
    if not cfg.tracking.enable or cfg.tracking.parent_run_id or not parent_file.exists():
        return cfg
    tracking = dataclasses.replace(cfg.tracking, parent_run_id=parent_file.read_text().strip())
    return dataclasses.replace(cfg, tracking=tracking)


class RunGroup:
    """A parent MLflow run over several training jobs (a sweep's points, a parity check's layouts).
    Its id is left in `folder`, where the jobs find it; `finish` compares the jobs into it."""

    def __init__(self, tracking: TrackingConfig, name: str, folder: Path, params: dict[str, object]):
        from titan_exp.tracking.mlflow_run import ROLE_TAG, MlflowRun, absolute_uri, ensure_store

        self.uri = absolute_uri(tracking.uri)
        self.folder = folder
        tracking = dataclasses.replace(tracking, uri=self.uri)
        ensure_store(tracking)
        self.run = MlflowRun.create(tracking, name[:_MAX_RUN_NAME], {ROLE_TAG: "sweep", "sweep_dir": str(folder)})
        try:
            self.run.log_params(params)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / PARENT_RUN_FILE).write_text(self.run.run_id)
        except Exception as err:
            self.run.finish("FAILED", f"{type(err).__name__}: {err}")
            raise
        print(f"MLflow parent run {self.run.run_id} ({name}) for the jobs in {folder}", flush=True)

    @property
    def run_id(self) -> str:
        return self.run.run_id

    def finish(self, failed_jobs: int = 0, interrupted: bool = False, failure: str | None = None) -> None:
        """Compare the jobs into the parent run (and `folder`/compare), then end it: KILLED if
        interrupted, FAILED if a job failed (how many in `failure_reason`) or `failure` is given
        (the reason), else FINISHED."""
        from titan_exp.compare.report import compare_sweep

        out_dir = self.folder / "compare"
        try:
            report = compare_sweep(self.uri, self.run.run_id, out_dir)
            print(f"\n{report.markdown}tables and plots: {out_dir} (and the parent run's compare/ artifacts)", flush=True)
            # A job that failed counts once, whether or not it got as far as a run of its own.
            failed = max(failed_jobs, sum(row.status != "FINISHED" for row in report.summaries))
            reason = f"{failed} sweep point(s) failed" if failed else failure
            failed = failed or failure is not None
        except Exception as err:  # the comparison must not leave the parent run open
            failed, reason = 1, f"comparison failed: {type(err).__name__}: {err}"
        status = "KILLED" if interrupted else "FAILED" if failed else "FINISHED"
        self.run.finish(status, "interrupted" if interrupted else reason)


class SweepParentRun(Callback):
    """Registered under hydra.callbacks (conf/config.yaml): Hydra calls it in the process that
    starts a multirun."""

    def __init__(self) -> None:
        self.group: RunGroup | None = None
        self.failed_points = 0

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        global _active
        tracking: TrackingConfig = OmegaConf.to_object(config.tracking)
        if not tracking.enable or tracking.parent_run_id:
            return  # nothing tracked, or the points join the parent the user named
        overrides = list(config.hydra.overrides.task)
        self.group = RunGroup(tracking, _parent_name(overrides), Path(config.hydra.sweep.dir), {"sweep.overrides": " ".join(overrides)})
        _active = self

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs) -> None:
        # Points that run in this process report here; a point's task returns False when it failed.
        if job_return.status != JobStatus.COMPLETED or job_return.return_value is False:
            self.failed_points += 1

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self.finish(interrupted=False)

    def finish(self, interrupted: bool, failure: str | None = None) -> None:
        global _active
        _active = None
        if self.group is not None:
            self.group.finish(self.failed_points, interrupted, failure)
            self.group = None


def _parent_name(overrides: list[str]) -> str:
    """'sweep: parallelism=ddp,fsdp': what the points vary (all overrides if Hydra finds no sweep among them)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    swept = [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()]
    return f"sweep: {' '.join(swept or overrides)}"[:_MAX_RUN_NAME]


def end_active_sweep(stopped_by: BaseException) -> None:
    """End the parent run of a sweep that `stopped_by` cut short: KILLED if interrupted, else FAILED."""
    if _active is not None:
        interrupted = isinstance(stopped_by, KeyboardInterrupt)
        _active.finish(interrupted, None if interrupted else f"the sweep stopped: {type(stopped_by).__name__}: {stopped_by}")

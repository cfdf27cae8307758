"""A Hydra multirun as one MLflow parent run, with each point's run as its child.

Hydra calls `SweepParentRun` in the process that starts the sweep: it creates the store and the
parent run before any point starts and leaves the parent's id in the sweep directory, where every
point finds it (tracking/parent_run.py). When the sweep is over it writes the strategy comparison
into the parent run and ends it. `close_parent` serves experiment=loss_parity's parent run too.
"""

import dataclasses
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from titan_exp.compare.report import compare_sweep
from titan_exp.config.schema import JobConfig
from titan_exp.tracking.config import TrackingConfig
from titan_exp.tracking.parent_run import ParentRun, parent_run_id_in

# The sweep this process started, if any: main() ends it as KILLED when the user interrupts.
_active: "SweepParentRun | None" = None
# The Hydra launcher of hydra_plugins/titan_exp_launcher (conf/config.yaml makes it the default).
TITAN_EXP_LAUNCHER = "hydra_plugins.titan_exp_launcher.titan_exp_launcher.TitanExpLauncher"
# Points of this process's sweep that failed (main() exits 1 if any did).
_failed_points = 0


def point_ended(ok: bool) -> None:
    global _failed_points
    _failed_points += not ok


def failed_points() -> int:
    return _failed_points


def join_sweep(cfg: JobConfig, sweep_dir: Path) -> JobConfig:
    """The point's config, its run a child of the sweep's parent run (if the sweep has one)."""
    parent_id = parent_run_id_in(sweep_dir)
    if not cfg.tracking.enable or cfg.tracking.parent_run_id or parent_id is None:
        return cfg
    return dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, parent_run_id=parent_id))


# The run's description, shown first on its Overview in MLflow's UI.
DESCRIPTION_TAG = "mlflow.note.content"
COMPARISON_NOTE = (
    "The comparison of these points: compare/strategy_table.html under Artifacts (with loss_curves.png, "
    "throughput.png, memory.png, scaling.png); `python -m titan_exp ui` prints a link to the points "
    "sorted by TPS/device."
)


def close_parent(
    parent: ParentRun, failed_jobs: int = 0, interrupted: bool = False, failure: str | None = None
) -> None:
    """Compare the jobs into the parent run (and its folder's compare/), then end it: KILLED if
    interrupted, FAILED if a job failed (how many in `failure_reason`) or `failure` is given (the
    reason), else FINISHED."""
    out_dir = parent.folder / "compare"
    try:
        report = compare_sweep(parent.uri, parent.run_id, out_dir)
        print(f"\n{report.markdown}tables and plots: {out_dir} (and the parent run's compare/ artifacts)", flush=True)
        parent.run.set_tag(DESCRIPTION_TAG, COMPARISON_NOTE)
        # A job that failed counts once, whether or not it got as far as a run of its own.
        failed = max(failed_jobs, sum(row.status != "FINISHED" for row in report.summaries))
        reason = f"{failed} sweep point(s) failed" if failed else failure
        failed = failed or failure is not None
    except Exception as err:  # the comparison must not leave the parent run open
        failed, reason = 1, f"comparison failed: {type(err).__name__}: {err}"
    status = "KILLED" if interrupted else "FAILED" if failed else "FINISHED"
    parent.run.finish(status, "interrupted" if interrupted else reason)


class SweepParentRun(Callback):
    """Registered under hydra.callbacks (conf/config.yaml): Hydra calls it in the process that
    starts a multirun."""

    def __init__(self) -> None:
        self.parent: ParentRun | None = None
        self.failed_points = 0
        self.config: DictConfig | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        global _active
        self.config, _active = config, self
        # titan_exp's own launcher opens the parent run once every point's config passed its
        # checks (open_parent_run), so that a refused sweep leaves nothing in the store.
        if config.hydra.launcher._target_ != TITAN_EXP_LAUNCHER:
            self.open()

    def open(self) -> None:
        """Create the parent run (when tracking is on and the user named none)."""
        tracking: TrackingConfig = OmegaConf.to_object(self.config.tracking)
        if not tracking.enable or tracking.parent_run_id:
            return  # nothing tracked, or the points join the parent the user named
        overrides = list(self.config.hydra.overrides.task)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        self.parent = ParentRun(tracking, _parent_name(overrides), sweep_dir, {"sweep.overrides": " ".join(overrides)})

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs) -> None:
        # Points that run in this process report here; a point's task returns False when it failed.
        if job_return.status != JobStatus.COMPLETED or job_return.return_value is False:
            self.failed_points += 1

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self.finish(interrupted=False)

    def finish(self, interrupted: bool, failure: str | None = None) -> None:
        global _active
        _active = None
        if self.parent is not None:
            close_parent(self.parent, self.failed_points, interrupted, failure)
            self.parent = None


def _parent_name(overrides: list[str]) -> str:
    """'sweep: parallelism=ddp,fsdp': what the points vary (all overrides if Hydra finds no sweep among them)."""
    swept = [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()]
    return f"sweep: {' '.join(swept or overrides)}"


def open_parent_run() -> None:
    """titan_exp's launcher: every point passed its checks; the sweep's parent run may start."""
    if _active is not None:
        _active.open()


def end_active_sweep(stopped_by: BaseException) -> None:
    """End the parent run of a sweep that `stopped_by` cut short: KILLED if interrupted, else FAILED."""
    if _active is not None:
        interrupted = isinstance(stopped_by, KeyboardInterrupt)
        reason = None if interrupted else f"the sweep stopped: {type(stopped_by).__name__}: {stopped_by}"
        _active.finish(interrupted, reason)

"""A sweep: several jobs under one MLflow parent run, compared when they are over. A Hydra multirun
is one (SweepParentRun, Hydra's callback, holds it from the first point to the last: a grid, or
every batch of trials an optimising sweeper such as Optuna launches), and so is a loss-parity check
(job/parity.py).

The parent run is opened once every point passed its checks, so that a refused sweep leaves nothing
in the store; its id is left in the sweep's folder, where a job started by other means finds it
(tracking/parent_run.py). When the sweep is over the strategy comparison is written into the parent
run, which ends FINISHED, FAILED (a point failed) or KILLED (interrupted).
"""

import dataclasses
import shlex
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from titan_exp.compare.report import compare_sweep
from titan_exp.config.schema import JobConfig
from titan_exp.job.outcome import EXIT_BAD_CONFIG, say, verdict
from titan_exp.rules import ConfigError
from titan_exp.tracking.config import TrackingConfig
from titan_exp.tracking.parent_run import ParentRun, parent_run_id_in
from titan_exp.tracking.run import SWEEP_OVERRIDES_PARAM

# The run's description, shown first on its Overview in MLflow's UI.
DESCRIPTION_TAG = "mlflow.note.content"
COMPARISON_NOTE = (
    "The comparison of these points: compare/strategy_table.html under Artifacts (with loss_curves.png, "
    "throughput.png, memory.png, scaling.png); `python -m titan_exp ui` prints a link to the points "
    "sorted by TPS/device."
)
# The Hydra launcher of hydra_plugins/titan_exp_launcher (titan_exp/conf/config.yaml makes it the default).
TITAN_EXP_LAUNCHER = "hydra_plugins.titan_exp_launcher.titan_exp_launcher.TitanExpLauncher"


class Sweep:
    """One sweep's state: its parent run (once opened), how many points failed, whether it ended."""

    def __init__(
        self, tracking: TrackingConfig, name: str, folder: Path, params: dict[str, object], own_parent: bool = False
    ):
        """`own_parent`: a parent run of its own even when the user named one (it is nested there);
        otherwise the points join the parent the user named."""
        self.tracking, self.name, self.folder, self.params = tracking, name, folder, params
        self.own_parent = own_parent
        self.parent: ParentRun | None = None
        self.failed = 0

    def open(self) -> str | None:
        """Create the parent run (when tracking is on); its id, or the one the user named."""
        wanted = self.own_parent or not self.tracking.parent_run_id
        if self.parent is None and self.tracking.enable and wanted:
            self.parent = ParentRun(self.tracking, self.name, self.folder, self.params)
        return self.parent.run_id if self.parent else self.tracking.parent_run_id

    def point_ended(self, ok: bool) -> None:
        self.failed += not ok

    def finish(self, interrupted: bool = False, failure: str | None = None) -> None:
        """Compare the points into the parent run (and the folder's compare/), then end it: KILLED if
        interrupted (`failure`: by what), FAILED if a point failed (how many in `failure_reason`) or
        `failure` is given (the reason), else FINISHED."""
        parent, self.parent = self.parent, None
        if parent is None:
            return
        out_dir = parent.folder / "compare"
        try:
            report = compare_sweep(parent.uri, parent.run_id, out_dir)
            print(
                f"\n{report.markdown}tables and plots: {out_dir} (and the parent run's compare/ artifacts)", flush=True
            )
            parent.run.set_tag(DESCRIPTION_TAG, COMPARISON_NOTE)
            # A point that failed counts once, whether or not it got as far as a run of its own.
            failed = max(self.failed, sum(row.status != "FINISHED" for row in report.summaries))
            reason = f"{failed} sweep point(s) failed" if failed else failure
            failed = failed or failure is not None
        except Exception as err:  # the comparison must not leave the parent run open
            failed, reason = 1, f"comparison failed: {type(err).__name__}: {err}"
        status = "KILLED" if interrupted else "FAILED" if failed else "FINISHED"
        parent.end(status, (failure or "interrupted") if interrupted else reason)


# The multirun this process runs, if any: main() ends it as KILLED when the user interrupts, and
# exits 1 if a point failed.
_active: Sweep | None = None


def active_sweep() -> Sweep | None:
    return _active


class SweepParentRun(Callback):
    """Registered under hydra.callbacks (titan_exp/conf/config.yaml): Hydra calls it in the process that
    starts a multirun, which becomes a Sweep."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        global _active
        overrides = list(config.hydra.overrides.task)
        _refuse_sweeping_the_store(overrides)
        tracking: TrackingConfig = OmegaConf.to_object(config.tracking)
        folder = Path(config.hydra.sweep.dir)
        _active = Sweep(tracking, _parent_name(overrides), folder, {SWEEP_OVERRIDES_PARAM: shlex.join(overrides)})
        # titan_exp's own launcher opens the parent run once every point's config passed its checks;
        # under another launcher the points run as they come (and find the parent in the folder).
        if config.hydra.launcher._target_ != TITAN_EXP_LAUNCHER:
            _active.open()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs) -> None:
        # A point's task returns a PointReturn (titan_exp/objective.py): its objective, and whether it succeeded.
        if _active is not None:
            _active.point_ended(job_return.status == JobStatus.COMPLETED and job_return.return_value.ok)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if _active is not None:
            _active.finish()


def _parent_name(overrides: list[str]) -> str:
    """'sweep: parallelism=ddp,fsdp': what the points vary (all overrides if Hydra finds no sweep among them)."""
    swept = [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()]
    return f"sweep: {' '.join(swept or overrides)}"


def _refuse_sweeping_the_store(overrides: list[str]) -> None:
    """A sweep's points and its parent run live in one store (the parent nests the points, the
    comparison reads them there): a sweep over tracking.uri exits here, before anything is written."""
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override() and override.key_or_group == "tracking.uri":
            err = ConfigError(
                "tracking.uri",
                override.input_line.split("=", 1)[1],
                "a sweep's points share one store (their parent run and comparison live there); "
                "run one sweep per store",
            )
            say(f"config error: {err}")
            raise SystemExit(EXIT_BAD_CONFIG)


def join_sweep(cfg: JobConfig, sweep_dir: Path) -> JobConfig:
    """A point that runs in the multirun's own process (another Hydra launcher than titan_exp's):
    its run a child of the sweep's parent run (if the sweep has one)."""
    parent_id = parent_run_id_in(sweep_dir)
    if not cfg.tracking.enable or cfg.tracking.parent_run_id or parent_id is None:
        return cfg
    return dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, parent_run_id=parent_id))


def end_active_sweep(stopped_by: BaseException) -> None:
    """End the parent run of a sweep that `stopped_by` cut short: KILLED if interrupted, else FAILED."""
    if _active is not None:
        interrupted = isinstance(stopped_by, KeyboardInterrupt)
        # Interrupted: by which signal ("stopped by SIGTERM"), as the points say it.
        why = verdict(stopped_by)[1] if interrupted else f"the sweep stopped: {type(stopped_by).__name__}: {stopped_by}"
        _active.finish(interrupted, why)

"""The Hydra side of titan_exp's sweeps: compose each point, hand the points to
titan_exp.job.sweep_points (each resolved and checked once, here), report each point's end to
Hydra's sweeper (its objective: titan_exp.objective) and callbacks (the sweep's parent run:
titan_exp.job.sweep)."""

import contextlib
import copy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from titan_exp.config.compose import check_label_overrides, to_job_config
from titan_exp.config.resolve import resolve
from titan_exp.config.schema import JobConfig
from titan_exp.job.held_batch import BATCH_KEYS, describe, hold_global_batch
from titan_exp.job.outcome import forget_folder, say
from titan_exp.job.sweep import active_sweep
from titan_exp.job.sweep_points import SweepPoint, check_every_point, label_points, labels, prepare_point, run_points
from titan_exp.objective import SweepConfig, check_sweeper, logged_value, point_return
from titan_exp.plan.prune import Pruned, prune, record_pruned
from titan_exp.rules import ConfigError


@dataclass
class TitanExpLauncherConf:
    _target_: str = "hydra_plugins.titan_exp_launcher.titan_exp_launcher.TitanExpLauncher"


# Hydra's default sweeper: a grid, whose points' return values nothing reads.
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"

ConfigStore.instance().store(group="hydra/launcher", name="titan_exp", node=TitanExpLauncherConf, provider="titan_exp")


class TitanExpLauncher(Launcher):
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.tokens_per_step: int | None = None  # what every point trains (job/held_batch.py), once known

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """One batch of points: the whole sweep under Hydra's basic sweeper, one batch of trials
        under an optimising one (Optuna, Nevergrad), which calls again with the next batch."""
        setup_globals()
        sweep_dir = Path(self.config.hydra.sweep.dir)
        optimising = self.config.hydra.sweeper._target_ != BASIC_SWEEPER
        with _refusal_exits(sweep_dir):
            _check_sweep_size(len(job_overrides), self.config.launcher.max_sweep_points)
            for overrides in job_overrides:
                check_label_overrides(overrides)
            if optimising:
                _check_optimising(self.config)
        configs = [self._point_config(overrides, initial_job_idx + i) for i, overrides in enumerate(job_overrides)]
        tasks = self._hold_global_batch(job_overrides, configs)
        points, pruned = _prepare_points(job_overrides, configs, tasks, sweep_dir)
        if optimising:  # a trial the config refuses fails alone: the sampler proposed it, not the user
            _fail_refused(points)
        else:
            with _refusal_exits(sweep_dir):
                check_every_point(points)  # a refused point refuses the sweep before anything starts
        sweep_dir.mkdir(parents=True, exist_ok=True)
        for point, config in zip(points, configs):
            _save_hydra_files(config, point.job_dir)
        sweep = active_sweep()
        parent = sweep.open() if sweep else None  # opened by the first batch, joined by the next ones
        launcher = self.config.launcher
        for found in pruned.values():
            record_pruned(found, parent)
        if to_run := [point for point in points if point.state == "queued"]:
            run_points(to_run, parent, launcher.max_parallel)
        return [self._report(point, config, optimising) for point, config in zip(points, configs)]

    def _hold_global_batch(
        self, job_overrides: Sequence[Sequence[str]], configs: list[DictConfig]
    ) -> list[JobConfig | ConfigError]:
        """The points' configs, each training the sweep's tokens per step (job/held_batch.py): the
        first batch's first point sets it, for the batches an optimising sweeper sends next too. A
        point's saved config (.hydra/config.yaml) says the batch it trains."""
        tasks = [_task(config) for config in configs]
        if self.config.hydra.sweeper._target_ != BASIC_SWEEPER and _searched(self.config) & set(BATCH_KEYS):
            return tasks  # a study of the batch itself: each trial trains the batch it was given
        labels = _labels(job_overrides, configs)
        held, found = hold_global_batch(tasks, labels, resolve, self.tokens_per_step)
        if len(held) > 1 and self.tokens_per_step is None:
            print(f"titan_exp: {describe(found, tasks[0].training.seq_len)}", flush=True)
        self.tokens_per_step = found.tokens_per_step
        for config, task in zip(configs, held):
            if isinstance(task, JobConfig):
                with read_write(config), open_dict(config):
                    config.training.local_batch_size = task.training.local_batch_size
                    config.training.global_batch_size = task.training.global_batch_size
        return held

    def _point_config(self, overrides: Sequence[str], number: int) -> DictConfig:
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config):
            config.hydra.job.id = number
            config.hydra.job.num = number
        return config

    def _report(self, point: SweepPoint, config: DictConfig, optimising: bool) -> JobReturn:
        """The point's end as Hydra's sweeper and callbacks expect it: its objective, read back from
        its MLflow run when a sweeper optimises it, and whether it succeeded (a PointReturn)."""
        ok = point.state in ("done", "pruned")
        if point.state == "pruned":
            print(f"titan_exp: sweep point [{point.number}] {point.overrides}: {point.detail}", file=sys.stderr)
        elif not ok:
            print(f"titan_exp: sweep point [{point.number}] {point.label} failed: {point.detail}", file=sys.stderr)
        value = _logged_objective(point, config.sweep.objective) if optimising and point.state == "done" else None
        result = JobReturn(
            overrides=point.overrides, cfg=config, hydra_cfg=config, working_dir=str(point.job_dir),
            task_name=config.hydra.job.name, status=JobStatus.COMPLETED,
        )  # fmt: skip
        result.return_value = point_return(config.sweep.objective, value, ok)
        self.hydra_context.callbacks.on_job_end(config=config, job_return=result)
        return result


def _searched(config: DictConfig) -> set[str]:
    """The keys an optimising sweeper searches: its own params and the command line's sweeps."""
    keys = set(OmegaConf.to_container(config.hydra.sweeper).get("params") or {})
    for override in OverridesParser.create().parse_overrides(list(config.hydra.overrides.task)):
        if override.is_sweep_override():
            keys.add(override.get_key_element())
    return keys


def _labels(job_overrides: Sequence[Sequence[str]], configs: list[DictConfig]) -> list[str]:
    named = labels([list(o) for o in job_overrides])
    return [f"[{config.hydra.job.num}] {label}" for config, label in zip(configs, named)]


def _prepare_points(
    job_overrides: Sequence[Sequence[str]],
    configs: list[DictConfig],
    tasks: list[JobConfig | ConfigError],
    sweep_dir: Path,
) -> tuple[list[SweepPoint], dict[int, Pruned]]:
    """Each point resolved and checked (or pruned: plan.prune=true, predicted not to fit; not started)."""
    points, pruned = [], {}
    for overrides, config, task in zip(job_overrides, configs, tasks):
        job_dir = sweep_dir / str(config.hydra.sweep.subdir)
        point = SweepPoint(config.hydra.job.num, list(overrides), job_dir)
        if isinstance(task, ConfigError):  # it cannot train the sweep's tokens per step
            point.refused = task
        elif found := prune(task):
            point.state, point.detail, pruned[point.number] = "pruned", found.reason, found
        else:
            point = prepare_point(point.number, point.overrides, job_dir, task)
        points.append(point)
    return points, pruned


def _check_optimising(config: DictConfig) -> None:
    """What an optimising sweeper needs of the sweep: a known objective, read back from each point's
    MLflow run, and a sweeper that goes the objective's way."""
    SweepConfig(config.sweep.objective).check("sweep")
    if not config.tracking.enable:
        sweeper = config.hydra.runtime.choices.get("hydra/sweeper", config.hydra.sweeper._target_)
        why = f"hydra/sweeper={sweeper} optimises sweep.objective, read from each point's MLflow run"
        raise ConfigError("tracking.enable", False, f"{why}; use tracking=mlflow")
    check_sweeper(config.sweep.objective, config.hydra.sweeper)


def _logged_objective(point: SweepPoint, objective: str) -> float | None:
    value = logged_value(objective, point.job.store.uri, point.job_dir)
    if value is None:
        say(f"sweep point [{point.number}] {point.label}: its run logged no {objective}")
    return value


def _fail_refused(points: list[SweepPoint]) -> None:
    label_points(points)
    for point in points:
        if point.refused is not None:
            point.state, point.detail = "failed", f"config error: {point.refused}"


@contextlib.contextmanager
def _refusal_exits(sweep_dir: Path):
    """A refused sweep exits here, as a single run does (Hydra would print a traceback for an
    exception), and leaves no sweep folder (Hydra's multirun.yaml holds the refused values)."""
    try:
        yield
    except ConfigError as err:
        print(f"titan_exp: config error: {err}", file=sys.stderr, flush=True)
        forget_folder(sweep_dir, ["multirun.yaml"])
        raise SystemExit(2) from None


def _check_sweep_size(points: int, cap: int) -> None:
    """Before any point is composed: a grid larger than meant (a typo in a range) starts nothing."""
    if cap != -1 and points > cap:
        raise ConfigError(
            "launcher.max_sweep_points",
            cap,
            f"the sweep has {points} points; raise it (or -1: no limit) if you mean to run them all",
        )


def _save_hydra_files(config: DictConfig, job_dir: Path) -> None:
    """What Hydra writes in a job's .hydra folder (the run logs them as config/hydra/*.yaml)."""
    folder = job_dir / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(_task_node(config), folder / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": config.hydra}), folder / "hydra.yaml")
    OmegaConf.save(config.hydra.overrides.task, folder / "overrides.yaml")


def _task_node(config: DictConfig) -> DictConfig:
    """The point's config without Hydra's node, as the task function would receive it."""
    task = copy.deepcopy(config)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return task


def _task(config: DictConfig):
    return to_job_config(_task_node(config), config.hydra.overrides.task)

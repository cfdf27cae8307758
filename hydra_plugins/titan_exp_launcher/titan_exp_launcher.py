"""The Hydra side of titan_exp's sweeps: compose each point, hand the points to
titan_exp.job.sweep_points (each resolved and checked once, here), report each point's end to
Hydra's callbacks (the sweep's parent run: titan_exp.job.sweep)."""

import contextlib
import copy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from titan_exp.config.compose import check_label_overrides, to_job_config
from titan_exp.job.outcome import forget_folder
from titan_exp.job.sweep import active_sweep
from titan_exp.job.sweep_points import SweepPoint, check_every_point, prepare_point, run_points
from titan_exp.plan.prune import prune, record_pruned
from titan_exp.rules import ConfigError


@dataclass
class TitanExpLauncherConf:
    _target_: str = "hydra_plugins.titan_exp_launcher.titan_exp_launcher.TitanExpLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="titan_exp", node=TitanExpLauncherConf, provider="titan_exp")


class TitanExpLauncher(Launcher):
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        sweep_dir = Path(self.config.hydra.sweep.dir)
        with _refusal_exits(sweep_dir):
            _check_sweep_size(len(job_overrides), self.config.launcher.max_sweep_points)
            for overrides in job_overrides:
                check_label_overrides(overrides)
        configs = [self._point_config(overrides, initial_job_idx + i) for i, overrides in enumerate(job_overrides)]
        points, pruned = [], {}
        for overrides, config in zip(job_overrides, configs):
            job_dir = sweep_dir / str(config.hydra.sweep.subdir)
            task = _task(config)
            point = SweepPoint(config.hydra.job.num, list(overrides), job_dir)
            if found := prune(task):  # plan.prune=true: predicted not to fit, not started
                point.state, point.detail, pruned[point.number] = "pruned", found.reason, found
            else:
                point = prepare_point(point.number, point.overrides, job_dir, task)
            points.append(point)
        with _refusal_exits(sweep_dir):
            check_every_point(points)  # a refused point refuses the sweep before anything starts
        sweep_dir.mkdir(parents=True, exist_ok=True)
        for point, config in zip(points, configs):
            _save_hydra_files(config, point.job_dir)
        sweep = active_sweep()
        parent = sweep.open() if sweep else None
        launcher = self.config.launcher
        for found in pruned.values():
            record_pruned(found, parent)
        if to_run := [point for point in points if point.number not in pruned]:
            run_points(to_run, parent, launcher.max_parallel, launcher.array_parallelism)
        return [self._report(point, config) for point, config in zip(points, configs)]

    def _point_config(self, overrides: Sequence[str], number: int) -> DictConfig:
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config):
            config.hydra.job.id = number
            config.hydra.job.num = number
        return config

    def _report(self, point: SweepPoint, config: DictConfig) -> JobReturn:
        """The point's end as Hydra's callbacks expect it (return value: whether it succeeded)."""
        ok = point.state in ("done", "pruned")
        if point.state == "pruned":
            print(f"titan_exp: sweep point [{point.number}] {point.overrides}: {point.detail}", file=sys.stderr)
        elif not ok:
            print(f"titan_exp: sweep point [{point.number}] {point.label} failed: {point.detail}", file=sys.stderr)
        result = JobReturn(
            overrides=point.overrides, cfg=config, hydra_cfg=config, working_dir=str(point.job_dir),
            task_name=config.hydra.job.name, status=JobStatus.COMPLETED,
        )  # fmt: skip
        result.return_value = ok
        self.hydra_context.callbacks.on_job_end(config=config, job_return=result)
        return result


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
    return to_job_config(_task_node(config))

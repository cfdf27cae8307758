"""`python -m titan_exp [overrides] [-m]`: compose with Hydra, resolve (check), run the job.
`python -m titan_exp compare ...` and `python -m titan_exp ui ...`: compare tracked runs, serve the MLflow UI.
`python -m titan_exp sync DIR...`: write what the store missed from jobs' journals (tracking/sync.py).
`python -m titan_exp plan [overrides]`: predict memory and speed without running (plan/cli.py).

Nothing here (nor anything it imports) loads torch: the ranks do (tests/test_architecture.py)."""

import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from launchers import signals
from titan_exp import ui
from titan_exp.compare import cli as compare_cli
from titan_exp.config.check import ConfigError
from titan_exp.config.compose import to_job_config
from titan_exp.config.resolve import resolve
from titan_exp.config.schema import register_schema
from titan_exp.job.launch import run_job
from titan_exp.job.parity import run_parity
from titan_exp.job.sweep import end_active_sweep, failed_points, join_sweep, point_ended
from titan_exp.metrics import startup
from titan_exp.plan import cli as plan_cli
from titan_exp.tracking import sync

# Exit statuses: 1 a run failed, 2 the config was rejected (nothing started).
EXIT_RUN_FAILED = 1
EXIT_BAD_CONFIG = 2

_SUBCOMMANDS = {"compare": compare_cli.main, "ui": ui.main, "sync": sync.main, "plan": plan_cli.main}
_state = {"task_started": False}


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _task(composed: DictConfig) -> bool:
    """One run (or one sweep point); returns whether it succeeded (a sweep's callback counts it)."""
    _state["task_started"] = True
    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    job_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        cfg = to_job_config(composed)
        if sweeping:
            cfg = join_sweep(cfg, Path(hydra_cfg.sweep.dir))
        if cfg.parity.layouts:
            if not run_parity(cfg, list(hydra_cfg.overrides.task), job_dir):
                raise RuntimeError(f"a layout's loss left the parity tolerance {cfg.parity.rtol:g}")
            return True
        resolved = resolve(cfg)
        startup.mark("compose")
        run_job(resolved, job_dir)
        return True
    except ConfigError as err:
        print(f"titan_exp: config error: {err}", file=sys.stderr, flush=True)
        if not sweeping:
            sys.exit(EXIT_BAD_CONFIG)
    except Exception as err:  # a failed run is reported; in a sweep the other points still run
        said = "; ".join([f"run failed: {type(err).__name__}: {err}", *getattr(err, "__notes__", [])])
        print(f"titan_exp: {said}", file=sys.stderr, flush=True)
        if not sweeping:
            sys.exit(EXIT_RUN_FAILED)
    if sweeping:
        point_ended(ok=False)
    return False


def main() -> None:
    startup.mark("python_imports")
    if len(sys.argv) > 1 and sys.argv[1] in _SUBCOMMANDS:
        sys.exit(_SUBCOMMANDS[sys.argv[1]](sys.argv[2:]))
    register_schema()
    try:
        with signals.handled(signals.raise_interrupted, signal.SIGTERM):
            _task()
    except BaseException as err:
        # A sweep that stops early (interrupted, or Hydra rejects a later point's overrides) still
        # ends its parent run.
        end_active_sweep(err)
        if isinstance(err, SystemExit) and err.code == 1 and not _state["task_started"]:
            # Hydra reports composition errors (unknown key, unknown option) itself with status 1,
            # before our task runs: those are config errors too.
            sys.exit(EXIT_BAD_CONFIG)
        if isinstance(err, KeyboardInterrupt):
            # One line, and the status a shell gives a process that such a signal stopped.
            signum = getattr(err, "signum", signal.SIGINT)
            said = "; ".join([f"stopped by {signal.Signals(signum).name}", *getattr(err, "__notes__", [])])
            print(f"titan_exp: {said}", file=sys.stderr, flush=True)
            sys.exit(128 + signum)
        raise
    if failed_points():
        print(f"titan_exp: {failed_points()} sweep point(s) failed", file=sys.stderr)
        sys.exit(EXIT_RUN_FAILED)


if __name__ == "__main__":
    main()

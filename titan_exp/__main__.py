"""`titan_exp [overrides] [-m]` (or `python -m titan_exp`): compose with Hydra, resolve, pre-flight,
run the job. `titan_exp SUBCOMMAND ...`: the subcommands of `_SUBCOMMANDS` (show, plan, compare, ui,
sync, export); `titan_exp --help`: the project's page (help_page.py).

Nothing here (nor anything it imports) loads torch: the ranks do (tests/test_architecture.py)."""

import contextlib
import os
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from launchers import signals
from titan_exp import CONF_DIR, help_page, ui
from titan_exp.compare import cli as compare_cli
from titan_exp.config.check import cautions
from titan_exp.config.compose import to_job_config
from titan_exp.config.schema import register_schema
from titan_exp.job import export, show
from titan_exp.job.launch import run_job
from titan_exp.job.outcome import (
    EXIT_BAD_CONFIG,
    EXIT_RUN_FAILED,
    composition_error,
    exit_status,
    forget_folder,
    say,
    where_it_went,
)
from titan_exp.job.parity import run_parity
from titan_exp.job.preflight import preflight
from titan_exp.job.resume import resolve_to_run
from titan_exp.job.sweep import active_sweep, end_active_sweep, join_sweep
from titan_exp.metrics import startup
from titan_exp.objective import PointReturn, point_return
from titan_exp.plan import cli as plan_cli
from titan_exp.tracking import sync

# Each subcommand's entry point and its line on `titan_exp --help`.
_SUBCOMMANDS = {
    "show": (show.main, "the resolved job: mesh, ranks, global batch, accumulation, dtype, device profile"),
    "plan": (
        plan_cli.main,
        "predict memory, step time and MFU without running; a grid ranked best first; "
        "`plan calibrate`: a profile fitted to your runs",
    ),
    "compare": (compare_cli.main, "the strategy table and plots of a sweep or an experiment's runs"),
    "ui": (ui.main, "MLflow's UI on the project's store, opened on the runs"),
    "sync": (sync.main, "write into the store what jobs journaled but the store missed"),
    "export": (export.main, "a checkpoint already written (any layout's) as a Hugging Face folder"),
}


# The cautions said so far in this process.
_said_already: set[str] = set()


class TaskExit(SystemExit):
    """The task's own exit (a refused config, a failed run), told apart from Hydra's: Hydra reports
    a composition error (unknown key, unknown option) itself with status 1, before the task runs."""


# By its absolute path: relative, Hydra would look for a Python package `conf` when this runs as
# the installed `titan_exp` command (the module then is titan_exp.__main__).
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _task(composed: DictConfig) -> PointReturn:
    """One run (or one sweep point run in this process); returns its sweep objective and whether it
    succeeded (a sweep's callback counts it, an optimising sweeper reads the objective)."""
    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    job_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        cfg = to_job_config(composed, hydra_cfg.overrides.task)
        if sweeping:
            cfg = join_sweep(cfg, Path(hydra_cfg.sweep.dir))
        if cfg.parity.layouts:
            if not run_parity(cfg, list(hydra_cfg.overrides.task), job_dir):
                raise RuntimeError(f"a layout's loss left the parity tolerance {cfg.parity.rtol:g}")
            return point_return(cfg.sweep.objective, None)
        job = resolve_to_run(cfg, job_dir)
        preflight(job)
        for caution in cautions(cfg, job.dims):
            if caution not in _said_already:  # a sweep's points share most of theirs: each is said once
                _said_already.add(caution)
                say(caution)
        startup.mark("compose")
        metrics = run_job(job, job_dir)
        if not job.dry_run and not sweeping and os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 says it
            say(f"done: {where_it_went(job, job_dir)}")
        return point_return(cfg.sweep.objective, metrics.get(cfg.sweep.objective))
    except Exception as err:  # a failed run is reported; in a sweep the other points still run
        status = exit_status(err)
        if not sweeping:
            if status == EXIT_BAD_CONFIG:
                forget_folder(job_dir, [".hydra", f"{hydra_cfg.job.name}.log"])
            raise TaskExit(status) from None
    return point_return(composed.sweep.objective, None, ok=False)


def _complete_subcommands() -> None:
    """Tab completion (Hydra's, `eval "$(titan_exp -sc install=bash)"`) also offers the subcommands
    for the first word; Hydra then adds the groups and keys."""
    line = os.environ.get("COMP_LINE", "")
    words = line.split()[1:] if line.endswith(" ") else line.split()[1:-1]
    partial = "" if line.endswith(" ") else line.split()[-1]
    if not words:  # completing the first word
        print(" ".join(name for name in _SUBCOMMANDS if name.startswith(partial)))


@contextlib.contextmanager
def _reader_may_leave():
    """`titan_exp show ... | head`: the reader closing the pipe ends the command quietly, with the
    status of a process SIGPIPE ended (no traceback; Python's documented way, on stdout's flush too)."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)


def main() -> None:
    startup.mark("python_imports")
    if len(sys.argv) > 1 and sys.argv[1] in _SUBCOMMANDS:
        with _reader_may_leave():
            sys.exit(_SUBCOMMANDS[sys.argv[1]][0](sys.argv[2:]))
    if sys.argv[1:3] == ["-sc", "query=bash"]:
        _complete_subcommands()
    if len(sys.argv) > 1 and sys.argv[1] in ("--help", "-h"):
        with _reader_may_leave():
            sys.stdout.write(help_page.page({name: summary for name, (_, summary) in _SUBCOMMANDS.items()}))
        return
    register_schema()
    # Hydra then raises a config it cannot compose to us (one line below) rather than printing
    # several; a user who set it keeps Hydra's full traceback.
    full_error = "HYDRA_FULL_ERROR" in os.environ
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        with signals.handled(signals.raise_interrupted, signal.SIGTERM):
            _task()
    except HydraException as err:
        end_active_sweep(err)
        if full_error:
            raise
        say(f"config error: {composition_error(err)}")
        sys.exit(EXIT_BAD_CONFIG)
    except BaseException as err:
        # A sweep that stops early (interrupted, or Hydra rejects a later point's overrides) still
        # ends its parent run.
        end_active_sweep(err)
        if isinstance(err, TaskExit):
            raise
        if isinstance(err, SystemExit) and err.code == 1:
            sys.exit(EXIT_BAD_CONFIG)  # Hydra's own report of a config it could not compose
        if isinstance(err, KeyboardInterrupt):
            sys.exit(exit_status(err))
        raise
    sweep = active_sweep()
    if sweep is not None and sweep.failed:
        say(f"{sweep.failed} sweep point(s) failed")
        sys.exit(EXIT_RUN_FAILED)


if __name__ == "__main__":
    main()

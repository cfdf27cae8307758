"""`python -m titan_exp [overrides] [-m]`: compose with Hydra, check, train.
`python -m titan_exp compare ...` and `python -m titan_exp ui ...`: compare tracked runs, serve the MLflow UI."""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from titan_exp.config.check import ConfigError
from titan_exp.config.schema import register_schema

# Exit statuses: 1 a run failed, 2 the config was rejected (nothing started).
EXIT_RUN_FAILED = 1
EXIT_BAD_CONFIG = 2

_state = {"task_started": False, "failures": 0}


def _compare(argv: list[str]) -> int:
    from titan_exp.compare.__main__ import main as compare

    return compare(argv)


def _ui(argv: list[str]) -> int:
    from titan_exp.ui import main as ui

    return ui(argv)


_SUBCOMMANDS = {"compare": _compare, "ui": _ui}


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _task(composed: DictConfig) -> bool:
    """One run (or one sweep point); returns whether it succeeded (a sweep's callback counts it)."""
    _state["task_started"] = True
    from titan_exp.job import prepare, run_job

    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        cfg = OmegaConf.to_object(composed)
        if sweeping:
            from titan_exp.tracking.sweep import join_sweep

            cfg = join_sweep(cfg, Path(hydra_cfg.sweep.dir))
        if cfg.parity.layouts:
            from titan_exp.parity import run_parity

            if not run_parity(cfg, list(hydra_cfg.overrides.task), Path(hydra_cfg.runtime.output_dir)):
                raise RuntimeError(f"a layout's loss left the parity tolerance {cfg.parity.rtol:g}")
            return True
        cfg, placement = prepare(cfg)
        run_job(cfg, placement, Path(hydra_cfg.runtime.output_dir))
        return True
    except ConfigError as err:
        print(f"titan_exp: config error: {err}", file=sys.stderr, flush=True)
        if not sweeping:
            sys.exit(EXIT_BAD_CONFIG)
    except Exception as err:  # a failed run is reported; in a sweep the other points still run
        print(f"titan_exp: run failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        if not sweeping:
            sys.exit(EXIT_RUN_FAILED)
    _state["failures"] += 1
    return False


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in _SUBCOMMANDS:
        sys.exit(_SUBCOMMANDS[sys.argv[1]](sys.argv[2:]))
    register_schema()
    try:
        _task()
    except BaseException as err:
        # A sweep that stops early (interrupted, or Hydra rejects a later point's overrides) still
        # ends its parent run.
        from titan_exp.tracking.sweep import end_active_sweep

        end_active_sweep(err)
        if isinstance(err, SystemExit) and err.code == 1 and not _state["task_started"]:
            # Hydra reports composition errors (unknown key, unknown option) itself with status 1,
            # before our task runs: those are config errors too.
            sys.exit(EXIT_BAD_CONFIG)
        raise
    if _state["failures"]:
        print(f"titan_exp: {_state['failures']} sweep point(s) failed", file=sys.stderr)
        sys.exit(EXIT_RUN_FAILED)


if __name__ == "__main__":
    main()

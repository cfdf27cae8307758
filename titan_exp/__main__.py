"""`python -m titan_exp [overrides] [-m]`: compose with Hydra, check, train."""

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


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _task(composed: DictConfig) -> None:
    _state["task_started"] = True
    from titan_exp.job import prepare, run_job

    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        cfg = OmegaConf.to_object(composed)
        if cfg.parity.layouts:
            from titan_exp.parity import run_parity

            if not run_parity(cfg, list(hydra_cfg.overrides.task), Path(hydra_cfg.runtime.output_dir)):
                raise RuntimeError(f"a layout's loss left the parity tolerance {cfg.parity.rtol:g}")
            return
        cfg, placement = prepare(cfg)
        run_job(cfg, placement, Path(hydra_cfg.runtime.output_dir))
    except ConfigError as err:
        print(f"titan_exp: config error: {err}", file=sys.stderr, flush=True)
        if not sweeping:
            sys.exit(EXIT_BAD_CONFIG)
        _state["failures"] += 1
    except Exception as err:  # a failed run is reported; in a sweep the other points still run
        print(f"titan_exp: run failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        if not sweeping:
            sys.exit(EXIT_RUN_FAILED)
        _state["failures"] += 1


def main() -> None:
    register_schema()
    try:
        _task()
    except SystemExit as exit_:
        # Hydra reports composition errors (unknown key, unknown option) itself with status 1,
        # before our task runs: those are config errors too.
        if exit_.code == 1 and not _state["task_started"]:
            sys.exit(EXIT_BAD_CONFIG)
        raise
    if _state["failures"]:
        print(f"titan_exp: {_state['failures']} sweep point(s) failed", file=sys.stderr)
        sys.exit(EXIT_RUN_FAILED)


if __name__ == "__main__":
    main()

"""What a sweep optimises: the `sweep` section (sweep.objective, a metric the points log), what
each point returns to Hydra's sweeper (a PointReturn), and the check that an optimising sweeper
(hydra/sweeper=optuna or nevergrad) goes the way the metric is better. Hydra's basic sweeper reads
no return value: a grid runs as it always did.

A unit of its own, torch-free: the schema (config/) registers the section, and the launching side
(job/, the Hydra launcher, the command line) reads it.
"""

import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from titan_exp import metric_names as names
from titan_exp.rules import ConfigError, Section, one_of
from titan_exp.tracking.journal import RUN_ID_FILE
from titan_exp.tracking.store import client, with_retries

# The metrics a sweep may optimise, each with the way it is better. A point returns its last
# logged value (for the _mean figures: the steady state over the whole run after its first interval).
OBJECTIVES = {
    names.LOSS: "minimize",
    names.TPS_MEAN: "maximize",
    names.TPS: "maximize",
    names.MFU_MEAN: "maximize",
    names.STEP_SECONDS: "minimize",
    names.MAX_ACTIVE_GIB: "minimize",  # CUDA ranks
    names.CPU_RSS_PEAK_GIB: "minimize",  # CPU ranks
}


@dataclass
class SweepConfig(Section):
    # What an optimising sweeper (hydra/sweeper=optuna or nevergrad) optimises: each point returns
    # its last logged value of this metric (the worst value if it failed); the sweeper must go
    # the metric's way (for throughput: hydra.sweeper.direction=maximize, Nevergrad's optim.maximize=true).
    objective: str = one_of(*OBJECTIVES)
    # What the points of a sweep or a plan grid hold fixed (job/held_batch.py): `global`, the tokens per
    # optimizer step (each point's local batch and accumulation derived from its data-parallel
    # degree), so that layouts are compared on the same work; `per_rank`, each point's local batch.
    batch: str = one_of("global", "per_rank")


class PointReturn(float):
    """What a sweep point's task returns to Hydra: a float, the point's objective (what Optuna's and
    Nevergrad's sweepers optimise), and `ok`, whether the point succeeded (what the sweep counts)."""

    ok: bool

    def __new__(cls, value: float, ok: bool = True) -> "PointReturn":
        made = super().__new__(cls, value)
        made.ok = ok
        return made

    def __reduce__(self):  # pickled by launchers that run tasks elsewhere (float's would drop `ok`)
        return PointReturn, (float(self), self.ok)


def point_return(objective: str, value: float | None, ok: bool = True) -> PointReturn:
    """`value`, or the worst value in the objective's direction for a point that failed or has none
    (pruned, a dry run, a parity check): Optuna and Nevergrad rank it last, their samplers learn to
    leave that region, and the study goes on (a nan would fail Optuna's trial, and its whole study
    at the end if every trial failed)."""
    if not ok or value is None or math.isnan(value):
        value = -math.inf if OBJECTIVES.get(objective) == "maximize" else math.inf
    return PointReturn(value, ok)


def check_sweeper(objective: str, sweeper: DictConfig) -> None:
    """Refuse an optimising sweeper set to go the other way than `objective` is better (Optuna and
    Nevergrad both minimise unless told otherwise)."""
    wanted = OBJECTIVES[objective]
    why = f"sweep.objective={objective} is {wanted}d"
    if "direction" in sweeper:
        given = sweeper.direction
        if isinstance(given, ListConfig):  # Optuna's multi-objective form
            given = [getattr(d, "name", d) for d in given]
            raise ConfigError("hydra.sweeper.direction", given, f"{why}, one objective; give one direction: {wanted}")
        given = getattr(given, "name", given)  # Optuna's default is an enum
        if given != wanted:
            raise ConfigError("hydra.sweeper.direction", given, f"{why}; add hydra.sweeper.direction={wanted}")
    maximize = OmegaConf.select(sweeper, "optim.maximize")
    if maximize is not None and maximize != (wanted == "maximize"):
        fix = f"{why}; add hydra.sweeper.optim.maximize={str(not maximize).lower()}"
        raise ConfigError("hydra.sweeper.optim.maximize", str(maximize).lower(), fix)


def logged_value(objective: str, uri: str, job_dir: Path) -> float | None:
    """The last value of `objective` that the job run in `job_dir` logged to its MLflow run, if any."""
    run_id_file = job_dir / RUN_ID_FILE
    if not run_id_file.exists():
        return None
    run = with_retries(lambda: client(uri).get_run(run_id_file.read_text().strip()))
    return run.data.metrics.get(objective)

"""`plan.prune=true` in a training sweep: a point predicted not to fit its memory budget is not
started; it is recorded under the sweep's parent run as a run of its own, status `pruned`, with
the predicted figures (torch-free: the memory prediction needs only the config)."""

import dataclasses
import time
from dataclasses import dataclass

from titan_exp.config.check import ConfigError
from titan_exp.config.schema import JobConfig
from titan_exp.estimate.memory import GIB
from titan_exp.job.identity import run_name, run_tags
from titan_exp.plan.predict import memory_budget_gib, predicted_memory, resolve_for_plan
from titan_exp.tracking.run import MlflowRun


@dataclass(frozen=True)
class Pruned:
    cfg: JobConfig  # resolved for planning
    reason: str
    figures: dict[str, float]


def prune(cfg: JobConfig) -> Pruned | None:
    """The point, if it is to be pruned (plan.prune=true) and is predicted not to fit; None if it
    fits, is not to be pruned, or its config is refused (the sweep's checks then name it)."""
    if not cfg.plan.prune:
        return None
    try:
        planned = resolve_for_plan(cfg)
    except ConfigError:
        return None
    memory = predicted_memory(planned)
    predicted, budget = memory.total / GIB, memory_budget_gib(planned, planned.hardware, planned.plan)
    if predicted <= budget:
        return None
    reason = (
        f"pruned: predicted {predicted:.2f} GiB per rank ({memory.describe()}) > budget {budget:.2f} GiB "
        f"(hardware={planned.hardware.name}; plan.memory_budget_gib, plan.memory_margin)"
    )
    figures = {"prediction/peak_memory_gib": predicted, "prediction/memory_budget_gib": budget}
    return Pruned(planned, reason, figures)


def record_pruned(pruned: Pruned, parent_run_id: str | None) -> None:
    """As a run under the sweep's parent: ended KILLED, tagged status=pruned with the reason."""
    cfg = pruned.cfg
    if not cfg.tracking.enable:
        return
    tracking = dataclasses.replace(cfg.tracking, parent_run_id=parent_run_id)
    run = MlflowRun.create(tracking, run_name(cfg), run_tags(cfg, "plan"))
    run.log_metrics([(0, pruned.figures, int(time.time() * 1000))])
    run.finish("KILLED", pruned.reason)
    run.set_tag("status", "pruned")

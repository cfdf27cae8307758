"""`plan.prune=true` in a training sweep: a point predicted not to fit its memory budget is not
started; it is recorded under the sweep's parent run as a run of its own, status `pruned`, with
the predicted figures (torch-free: the memory prediction needs only the config)."""

import time
from dataclasses import dataclass

from titan_exp.config.job import ResolvedJob
from titan_exp.config.schema import JobConfig
from titan_exp.plan.predict import memory_budget_gib, predicted_memory, resolve_for_plan
from titan_exp.rules import ConfigError
from titan_exp.tracking.run import MlflowRun
from titan_exp.units import GIB


@dataclass(frozen=True)
class Pruned:
    job: ResolvedJob  # resolved for planning
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
    cfg = planned.config
    memory = predicted_memory(cfg)
    predicted, budget = memory.total / GIB, memory_budget_gib(cfg, cfg.hardware, cfg.plan)
    if predicted <= budget:
        return None
    reason = (
        f"pruned: predicted {predicted:.2f} GiB per rank ({memory.describe()}) > budget {budget:.2f} GiB "
        f"(hardware={cfg.hardware.name}; plan.memory_budget_gib, plan.memory_margin)"
    )
    figures = {"prediction/peak_memory_gib": predicted, "prediction/memory_budget_gib": budget}
    return Pruned(planned, reason, figures)


def record_pruned(pruned: Pruned, parent_run_id: str | None) -> None:
    """As a run under the sweep's parent: ended KILLED, tagged status=pruned with the reason."""
    job = pruned.job
    if job.store is None:
        return
    if parent_run_id:
        job = job.with_parent_run(parent_run_id)
    run = MlflowRun.create(job.config.tracking, job.run_name(), job.run_tags("plan"))
    run.log_metrics([(0, pruned.figures, int(time.time() * 1000))])
    run.finish("KILLED", pruned.reason)
    run.set_tag("status", "pruned")

"""`plan.prune=true` in a training sweep: a point predicted not to fit its memory budget is not
started; it is recorded under the sweep's parent run as a run of its own, status `pruned`, with
the predicted figures (torch-free: the memory prediction needs only the config)."""

import time
from dataclasses import dataclass

from titan_exp.config.job import ResolvedJob
from titan_exp.config.schema import JobConfig
from titan_exp.estimate.memory import rank_memory
from titan_exp.job.memory import memory_fixes, planned_device, workload
from titan_exp.plan.predict import memory_budget, resolve_for_plan
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
    w = workload(cfg, planned_device(cfg))
    memory, budget = rank_memory(w), memory_budget(cfg, cfg.hardware)
    predicted, per_rank = memory.reserved / GIB, budget.per_rank(cfg.launcher.nproc_per_node) / GIB
    if predicted <= per_rank:
        return None
    fixes = memory_fixes(cfg, w, budget)
    reason = (
        f"pruned: predicted {predicted:.2f} GiB per rank ({memory.describe()}) > budget {per_rank:.2f} GiB "
        f"({budget.where})" + (f"; fits with {' or '.join(fixes)}" if fixes else "")
    )
    figures = {"prediction/peak_memory_gib": predicted, "prediction/memory_budget_gib": per_rank}
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

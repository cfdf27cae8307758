"""The learning-rate schedule of the optimizers: its shape is optim/config.py's lr_factor."""

import torch
from torch.optim.lr_scheduler import LambdaLR

from titan_exp.optim.config import LRSchedulerConfig, lr_factor


def build_lr_scheduler(optimizer: torch.optim.Optimizer, steps: int, cfg: LRSchedulerConfig) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, steps, cfg))


def follow_this_schedule(scheduler: LambdaLR, base_lrs: list[float]) -> None:
    """After a resume: this job's peak LRs (`base_lrs`, optimizer.lr: the saved state restores the
    saved job's) and the LR of the step the schedule is at, from this job's schedule. The
    optimizer's saved state sets the saved job's LR (from a schedule over its training.steps), which
    would stand for one step and then jump to this job's (a resume with more steps)."""
    scheduler.base_lrs = list(base_lrs)
    for group, base in zip(scheduler.optimizer.param_groups, base_lrs):
        group["initial_lr"] = base
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports, as LambdaLR.step() would have set it

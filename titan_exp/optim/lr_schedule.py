"""The learning-rate schedule: linear warmup, then a stable phase, then decay (warmup-stable-decay)."""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from titan_exp.optim.config import LRSchedulerConfig


def lr_factor(step: int, steps: int, cfg: LRSchedulerConfig) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based) of `steps`."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    decay_steps = round((steps - cfg.warmup_steps) * cfg.decay_ratio)
    decay_start = steps - decay_steps
    if step < decay_start or decay_steps == 0:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    shapes = {
        "linear": 1.0 - progress,
        "sqrt": 1.0 - math.sqrt(progress),
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
    }
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shapes[cfg.decay_type]


def build_lr_scheduler(optimizer: torch.optim.Optimizer, steps: int, cfg: LRSchedulerConfig) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, steps, cfg))


def follow_this_schedule(scheduler: LambdaLR) -> None:
    """After a resume: the LR of the step the schedule is at, from this job's schedule. The
    optimizer's saved state sets the saved job's LR (from a schedule over its training.steps), which
    would stand for one step and then jump to this job's (a resume with more steps)."""
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports, as LambdaLR.step() would have set it

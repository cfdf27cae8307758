"""The `optimizer` and `lr_scheduler` sections (torchtitan's key names), and the schedule's shape
(lr_factor), torch-free: the launching process reads it too (a resume's line, job/resume.py)."""

import math
from dataclasses import dataclass

from titan_exp.rules import Section, check_at_least, check_in_range, check_positive, one_of


@dataclass
class OptimizerConfig(Section):
    name: str = one_of("AdamW")
    # Peak learning rate (after warmup).
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: str = one_of("foreach", "fused", "for-loop")

    def check(self, key: str) -> None:
        super().check(key)
        check_positive(f"{key}.lr", self.lr)
        check_positive(f"{key}.eps", self.eps)
        for name in ("beta1", "beta2"):
            check_in_range(f"{key}.{name}", getattr(self, name), 0.0, 1.0)
        check_in_range(f"{key}.weight_decay", self.weight_decay, 0.0, math.inf)


@dataclass
class LRSchedulerConfig(Section):
    warmup_steps: int = 10
    # Fraction of the steps after warmup spent decaying; the rest stays flat at the peak (WSD).
    decay_ratio: float = 1.0
    decay_type: str = one_of("linear", "sqrt", "cosine", default="cosine")
    # The LR decays to lr × min_lr_factor.
    min_lr_factor: float = 0.1

    def check(self, key: str) -> None:
        super().check(key)
        check_at_least(f"{key}.warmup_steps", self.warmup_steps, 0)
        for name in ("decay_ratio", "min_lr_factor"):
            check_in_range(f"{key}.{name}", getattr(self, name), 0.0, 1.0)


def lr_factor(step: int, steps: int, cfg: LRSchedulerConfig) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based) of `steps`: linear warmup, then a
    stable phase, then decay (warmup-stable-decay)."""
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

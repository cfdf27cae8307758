"""The `optimizer` and `lr_scheduler` sections (torchtitan's key names)."""

from dataclasses import dataclass


@dataclass
class OptimizerConfig:
    name: str = "AdamW"
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # foreach | fused | for-loop
    implementation: str = "foreach"


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 10
    # Fraction of the steps after warmup spent decaying; the rest stays flat at the peak (WSD).
    decay_ratio: float = 1.0
    # linear | sqrt | cosine
    decay_type: str = "cosine"
    # The LR decays to lr × min_lr_factor.
    min_lr_factor: float = 0.1

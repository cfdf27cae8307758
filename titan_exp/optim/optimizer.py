"""AdamW as torchtitan configures it (foreach, fused or for-loop), one per model part with its
learning-rate schedule."""

from dataclasses import dataclass

import torch
from torch import nn

from titan_exp.optim.config import LRSchedulerConfig, OptimizerConfig
from titan_exp.optim.lr_schedule import build_lr_scheduler


def build_optimizer(params, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=cfg.implementation == "foreach",
        fused=cfg.implementation == "fused",
    )


@dataclass
class Optimizers:
    """One optimizer (and schedule) per model part, so checkpoints address state by parameter name."""

    optimizers: list[torch.optim.Optimizer]
    schedulers: list

    @classmethod
    def build(
        cls, parts: list[nn.Module], cfg: OptimizerConfig, schedule: LRSchedulerConfig, steps: int
    ) -> "Optimizers":
        optimizers = [build_optimizer(part.parameters(), cfg) for part in parts]
        return cls(optimizers, [build_lr_scheduler(o, steps, schedule) for o in optimizers])

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def step(self) -> None:
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

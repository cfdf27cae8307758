"""AdamW as torchtitan configures it (foreach, fused or for-loop)."""

import torch

from titan_exp.optim.config import OptimizerConfig


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

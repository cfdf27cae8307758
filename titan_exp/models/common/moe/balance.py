"""The experts' load after each step: every MoE layer's routed rows per expert, summed over all
ranks (one all-reduce of a layers × experts matrix: each layer's rows come from the data- and
context-parallel ranks of its pipeline stage, and ranks not holding it add zeros), its max over
its mean (1.0 is perfect balance) for the metrics, DeepSeek-V3's bias update where
model.moe.load_balance_coeff is set, and Qwen3's auxiliary loss where model.moe.aux_loss_coeff is."""

import torch
import torch.distributed as dist

from titan_exp import metric_names as names
from titan_exp.models.common.moe.layer import MoE
from titan_exp.models.config import ModelConfig


class ExpertBalance:
    def __init__(self, parts: list[torch.nn.Module], cfg: ModelConfig, device: torch.device):
        # Each MoE layer this rank holds, by its index in the whole model.
        self.layers = {
            int(name.split(".")[1]): module
            for part in parts
            for name, module in part.named_modules()
            if isinstance(module, MoE)
        }
        self.cfg, self.device = cfg, device
        # Routed rows per expert of every layer, summed over the steps so far (for the run's plot).
        self.total = torch.zeros(cfg.n_layers, cfg.moe.num_experts, device=device)

    def after_step(self) -> dict[str, float]:
        """Move the biases (collectives: every rank calls it at the same step); returns the load's
        max/mean per layer (moe/load_imbalance/layer_N) and over the layers' worst
        (moe/load_imbalance), and the auxiliary loss summed over the layers (moe/aux_loss)."""
        moe = self.cfg.moe
        # Per layer: routed rows per expert, then the auxiliary loss's sum and the forwards it sums.
        stats = torch.zeros(self.cfg.n_layers, moe.num_experts + 2, device=self.device)
        for layer, module in self.layers.items():
            stats[layer] = torch.cat([module.tokens_per_expert, module.aux_loss_total])
            module.tokens_per_expert.zero_()
            module.aux_loss_total.zero_()
        if dist.is_initialized():
            dist.all_reduce(stats)
        counts, (aux_loss, forwards) = stats[:, : moe.num_experts], stats[:, moe.num_experts :].T
        self.total += counts
        if moe.load_balance_coeff is not None:
            with torch.no_grad():
                for layer, module in self.layers.items():
                    load = counts[layer]
                    module.router.expert_bias += moe.load_balance_coeff * torch.sign(load.mean() - load)
        # One copy to the host for every layer's ratio, not one per layer.
        ratios = (counts.amax(dim=1) / counts.mean(dim=1)).tolist()
        routed = (counts.sum(dim=1) > 0).tolist()
        imbalance = {
            layer: ratios[layer] for layer in range(self.cfg.n_layers) if self.cfg.is_moe_layer(layer) and routed[layer]
        }
        metrics = {f"{names.LOAD_IMBALANCE}/layer_{layer}": value for layer, value in imbalance.items()}
        if imbalance:
            metrics[names.LOAD_IMBALANCE] = max(imbalance.values())
        if moe.aux_loss_coeff is not None and imbalance:
            # Each layer's mean over its forwards (a microbatch's, on its data-parallel ranks).
            metrics[names.AUX_LOSS] = (aux_loss / forwards.clamp(min=1)).sum().item()
        return metrics

    def load_by_layer(self) -> dict[int, list[float]]:
        """Each MoE layer's routed rows per expert over the steps so far (all ranks')."""
        total = self.total.tolist()
        return {layer: total[layer] for layer in range(self.cfg.n_layers) if self.cfg.is_moe_layer(layer)}

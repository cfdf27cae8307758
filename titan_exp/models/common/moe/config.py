"""The `model.moe` section: mixture-of-experts feed-forward layers (models/common/moe/layer.py). Zero
experts is a dense model; the keys follow torchtitan's MoE args."""

from dataclasses import dataclass
from typing import Optional

from titan_exp.rules import ConfigError, Section, check_positive, one_of

# Hidden-wide tensors a SwiGLU keeps per hidden channel for its backward: w1's and w3's outputs,
# silu's, their product.
SWIGLU_KEPT = 4
# GPT-OSS's gate gain in its clamped SwiGLU (its config's swiglu_alpha: x·σ(1.702·x) is the
# sigmoid approximation of GELU).
CLAMPED_GATE_GAIN = 1.702


@dataclass
class MoEConfig(Section):
    # Routed experts of each MoE layer; 0: every feed-forward is dense (model.intermediate_size or
    # the multiple_of rule).
    num_experts: int = 0
    # Experts each token is sent to.
    top_k: int = 1
    # Each expert's SwiGLU hidden size (Hugging Face's moe_intermediate_size).
    hidden_dim: int = 0
    # Experts every token goes through beside its routed ones, as one SwiGLU of
    # num_shared_experts × hidden_dim (DeepSeek's shared experts).
    num_shared_experts: int = 0
    # The first layers keep a dense feed-forward (DeepSeek-V3: 3).
    n_dense_layers: int = 0
    # Router scores: a softmax over the experts (Qwen3) or a sigmoid per expert (DeepSeek-V3).
    score_func: str = one_of("softmax", "sigmoid")
    # The chosen experts' scores rescaled to sum to 1 (Hugging Face's norm_topk_prob).
    route_norm: bool = True
    # The routed experts' combined output scaled by this (DeepSeek-V3's routed_scaling_factor).
    route_scale: float = 1.0
    # Grouped routing (DeepSeek-V3): the experts fall into n_groups groups and a token's experts
    # come from its topk_groups best groups only.
    n_groups: int = 1
    topk_groups: int = 1
    # DeepSeek-V3's auxiliary-loss-free balancing: after each step, each expert's selection bias
    # moves this much toward the mean load (up if it got fewer tokens, down if more; 1e-3 in
    # DeepSeek-V3). The bias picks the experts, never weighs their outputs. None: no bias.
    load_balance_coeff: Optional[float] = None
    # Qwen3's auxiliary load-balancing loss (Hugging Face's router_aux_loss_coef): this times
    # num_experts × Σ_e (rows routed to e / tokens) × (e's mean router probability), added to the
    # loss in each MoE layer. The routed counts are the global batch's (summed over the ranks, as
    # Qwen3 was trained), so every layout adds the same loss. None: no auxiliary loss.
    aux_loss_coeff: Optional[float] = None
    # Over what that loss balances. all_layers: one loss of every MoE layer's routed fractions and
    # mean probabilities pooled (transformers' load_balancing_loss_func, which Qwen3-MoE's published
    # router_aux_loss_coef is set against); each_layer: a loss per layer, summed (GShard's and
    # Switch's form), which pulls each router L times as hard at the same coefficient.
    aux_loss_over: str = one_of("all_layers", "each_layer")
    # GPT-OSS's experts: the router's and every expert's linears add a bias.
    bias: bool = False
    # GPT-OSS's clamped SwiGLU: the gate clamped above at this, the up projection to ±this, then
    # (up + 1)·gate·σ(1.702·gate); None: silu(gate)·up.
    swiglu_limit: Optional[float] = None

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def check(self, key: str) -> None:
        super().check(key)
        if self.num_experts < 0:
            raise ConfigError(f"{key}.num_experts", self.num_experts, "must be >= 0 (0: a dense model)")
        if not self.enabled:
            return
        check_positive(f"{key}.hidden_dim", self.hidden_dim)
        for name in ("load_balance_coeff", "aux_loss_coeff", "swiglu_limit"):
            if getattr(self, name) is not None:
                check_positive(f"{key}.{name}", getattr(self, name))
        check_positive(f"{key}.route_scale", self.route_scale)
        if not 0 < self.top_k <= self.num_experts:
            raise ConfigError(f"{key}.top_k", self.top_k, f"must lie in [1, model.moe.num_experts={self.num_experts}]")
        if self.num_shared_experts < 0 or self.n_dense_layers < 0:
            name = "num_shared_experts" if self.num_shared_experts < 0 else "n_dense_layers"
            raise ConfigError(f"{key}.{name}", getattr(self, name), "must be >= 0")
        if self.n_groups < 1 or self.num_experts % self.n_groups:
            raise ConfigError(f"{key}.n_groups", self.n_groups, f"must divide model.moe.num_experts={self.num_experts}")
        if not 0 < self.topk_groups <= self.n_groups:
            raise ConfigError(
                f"{key}.topk_groups", self.topk_groups, f"must lie in [1, model.moe.n_groups={self.n_groups}]"
            )
        if self.topk_groups * (self.num_experts // self.n_groups) < self.top_k:
            raise ConfigError(
                f"{key}.topk_groups", self.topk_groups, f"leaves fewer experts than model.moe.top_k={self.top_k}"
            )

    def expert_parameters(self, dim: int) -> int:
        """One expert's: its SwiGLU's three matrices (and their biases)."""
        biases = 2 * self.hidden_dim + dim if self.bias else 0
        return 3 * dim * self.hidden_dim + biases

    @property
    def activation_kept(self) -> int:
        """Hidden-wide tensors an expert's row keeps for its backward: a SwiGLU's; the clamped
        form's seven (the gate and up each clamp reads, the sigmoid, the clamped gate, the gate
        times its sigmoid, up + 1, their product)."""
        return SWIGLU_KEPT if self.swiglu_limit is None else 7

    def router_parameters(self, dim: int) -> int:
        """The router's: a score per expert from the token (and a bias per expert)."""
        return (dim + self.bias) * self.num_experts

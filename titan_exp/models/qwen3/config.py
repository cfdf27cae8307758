"""Qwen3's `model` section (dense and mixture-of-experts): the shared one, with an RMSNorm over each
head's q and k before the rotary embedding, heads of their own width (attention_head_dim: 128 at
every size), and the figures the planner reads of those norms."""

from dataclasses import dataclass

from titan_exp.models.config import ModelConfig, PointwiseWidths


@dataclass
class Qwen3Config(ModelConfig):
    def attention_parameters(self) -> int:
        """Grouped-query attention's, and the q and k norms' weights (one head_dim each)."""
        return super().attention_parameters() + 2 * self.head_dim

    def attention_pointwise_widths(self) -> PointwiseWidths:
        """Grouped-query attention's, and the q and k norms over every head's channels."""
        widths = super().attention_pointwise_widths()
        return widths._replace(inner_norms=(self.n_heads + self.kv_heads) * self.head_dim)

    def attention_kept_per_token(self, norm_kept: int, cpu: bool, seq_len: int) -> tuple[float, float]:
        """Grouped-query attention's, and q and k before their norms (what the norms keep)."""
        whole, per_head = super().attention_kept_per_token(norm_kept, cpu, seq_len)
        return whole, per_head + norm_kept * (self.n_heads + self.kv_heads) * self.head_dim

"""GPT-OSS's `model` section: the shared one, with attention that adds biases to its projections and
a learned sink per head, every other layer attending to a sliding window, and YaRN's magnitude
factor on the attention scores; its experts (biases, a clamped SwiGLU) are `model.moe`'s keys."""

import math
from dataclasses import dataclass

from titan_exp.models.config import FLEX_BLOCK, ModelConfig
from titan_exp.rules import ConfigError, check_positive


@dataclass
class GptOssConfig(ModelConfig):
    # Layers 0, 2, 4, ... attend to the last sliding_window tokens (the query's own among them),
    # the others to the whole window: GPT-OSS alternates so from its first layer.
    sliding_window: int = 128
    # GPT-OSS's YaRN leaves its ramp's ends where they fall.
    rope_yarn_truncate: bool = False

    def check(self, key: str) -> None:
        super().check(key)
        check_positive(f"{key}.sliding_window", self.sliding_window)
        if self.sliding_window > self.max_seq_len:  # no sequence is longer: such a window never binds
            raise ConfigError(
                f"{key}.sliding_window",
                self.sliding_window,
                f"is wider than {key}.max_seq_len={self.max_seq_len}, the longest sequence, so it never binds; "
                f"set at most {self.max_seq_len}",
            )

    @staticmethod
    def is_sliding_layer(layer: int) -> bool:
        return layer % 2 == 0

    @property
    def context_parallel_refusal(self) -> str | None:
        return "GPT-OSS's attention (a sink per head, sliding windows) has no context-parallel form here"

    @property
    def attention_scale_factor(self) -> float:
        """What the scores are multiplied by beyond 1/√head_dim: YaRN's magnitude factor
        0.1·ln(factor) + 1 (its paper's Eq. 21), which transformers puts on both cos and sin, so on
        q and k, hence squared; 1 without YaRN."""
        if self.rope_scaling_factor is None or self.rope_scaling_type != "yarn" or self.rope_scaling_factor <= 1:
            return 1.0
        return (0.1 * math.log(self.rope_scaling_factor) + 1) ** 2

    def attention_parameters(self) -> int:
        """Grouped-query attention's linears, their biases, and one sink logit per head."""
        biases = sum(linear.fan_out for linear in self.attention_linears().values())
        return super().attention_parameters() + biases + self.n_heads

    def attention_kept_per_token(self, norm_kept: int, cpu: bool, seq_len: int) -> tuple[float, float]:
        """On a GPU grouped-query attention's (FlexAttention keeps q, k, v, its output and the
        log-sum-exp). On a CPU the scores are computed whole (models/gpt_oss/attention.py): per
        head q, k and v as it takes them, the probabilities over the keys and the sink (float32:
        two elements each at 16 bits; counted as one here, as the MLA math path), the output."""
        if not cpu:  # grouped-query attention's, and the output the sink's share scales (a copy)
            whole, per_head = super().attention_kept_per_token(norm_kept, cpu, seq_len)
            return whole, per_head + self.n_heads * self.head_dim
        return 0.0, self.n_heads * (4 * self.head_dim + seq_len + 1)

    def cuda_attention_kernel(self, document_mask: bool) -> str:
        """FlexAttention, mask or none: SDPA takes no sink (models/gpt_oss/attention.py)."""
        return "flex"

    def keys_per_query(self, keys: float, seq_len: int, cuda: bool) -> float:
        """On a GPU FlexAttention skips the blocks the mask empties and computes the others whole: a
        windowed layer's query block computes the key blocks its window touches (its own and
        ⌈window / block⌉ before it), the others `keys`. On a CPU every layer computes its whole
        seq_len × seq_len scores."""
        if not cuda:
            return float(seq_len)
        windowed = (math.ceil(self.sliding_window / FLEX_BLOCK) + 1) * FLEX_BLOCK
        sliding = sum(self.is_sliding_layer(layer) for layer in range(self.n_layers))
        return (sliding * min(keys, windowed) + (self.n_layers - sliding) * keys) / self.n_layers

"""The `model.mla` section: DeepSeek-V3's multi-head latent attention (models/deepseek_v3/attention.py).
A rank of 0 for the compressed keys and values means the model's attention is grouped-query."""

from dataclasses import dataclass

from titan_exp.rules import Section, check_at_least, check_positive


@dataclass
class MLAConfig(Section):
    # Keys and values go through a compressed latent of this width; 0: no latent attention.
    kv_lora_rank: int = 0
    # Queries go through a latent of this width too; 0: projected directly (the 16B model).
    q_lora_rank: int = 0
    # Each head's query/key width without and with the rotary embedding, and its value width.
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # YaRN's attention-scale coefficient: softmax scale × (0.1 · mscale · ln(rope factor) + 1)².
    mscale: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def check(self, key: str) -> None:
        super().check(key)
        if not self.enabled:
            return
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mscale"):
            check_positive(f"{key}.{name}", getattr(self, name))
        check_at_least(f"{key}.q_lora_rank", self.q_lora_rank, 0)

    def attention_parameters(self, dim: int, n_heads: int) -> int:
        """One layer's: the query path, the key-value latent and its norm, the output projection."""
        query = dim * n_heads * self.qk_head_dim
        if self.q_lora_rank:
            query = dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n_heads * self.qk_head_dim
        latent = dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        up = self.kv_lora_rank * n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return query + latent + up + n_heads * self.v_head_dim * dim

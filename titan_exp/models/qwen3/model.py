"""Qwen3 (dense and mixture-of-experts): the shared decoder with grouped-query attention that norms
each head's q and k before the rotary embedding."""

from titan_exp.models.common.attention import GroupedQueryAttention
from titan_exp.models.common.transformer import Transformer
from titan_exp.models.qwen3.config import Qwen3Config


class Qwen3Attention(GroupedQueryAttention):
    def __init__(self, cfg: Qwen3Config):
        super().__init__(cfg, qk_norm=True)


class Qwen3(Transformer):
    attention_class = Qwen3Attention

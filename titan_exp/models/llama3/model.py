"""Llama 3: the shared decoder with grouped-query attention."""

from titan_exp.models.common.attention import GroupedQueryAttention
from titan_exp.models.common.transformer import Transformer


class Llama3(Transformer):
    attention_class = GroupedQueryAttention

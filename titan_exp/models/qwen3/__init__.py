"""Qwen3, dense and mixture-of-experts: grouped-query attention with q/k norms, wider heads,
softmax-routed experts with an auxiliary load-balancing loss."""

from titan_exp.models.family import ModelFamily
from titan_exp.models.qwen3.config import Qwen3Config
from titan_exp.models.qwen3.hf_format import Qwen3Format

FAMILY = ModelFamily("qwen3", Qwen3Config, "titan_exp.models.qwen3.model:Qwen3", Qwen3Format())

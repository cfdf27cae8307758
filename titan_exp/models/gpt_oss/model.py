"""GPT-OSS: the shared decoder with attention sinks, sliding-window attention in every other layer
(its attention differs by layer) and experts with biases and a clamped SwiGLU."""

from torch import nn

from titan_exp.models.common.transformer import Transformer
from titan_exp.models.gpt_oss.attention import SinkAttention
from titan_exp.models.gpt_oss.config import GptOssConfig


class GptOss(Transformer):
    @classmethod
    def build_attention(cls, cfg: GptOssConfig, layer: int) -> nn.Module:
        return SinkAttention(cfg, layer)

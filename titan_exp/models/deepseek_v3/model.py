"""DeepSeek-V3: the shared decoder with multi-head latent attention."""

from titan_exp.models.common.transformer import Transformer
from titan_exp.models.deepseek_v3.attention import LatentAttention


class DeepSeekV3(Transformer):
    attention_class = LatentAttention

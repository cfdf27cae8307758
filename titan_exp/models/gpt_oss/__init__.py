"""GPT-OSS (OpenAI's 20B and 120B open-weight models): grouped-query attention with biases and a
learned sink per head, sliding-window (128) and full attention alternating, YaRN, and
mixture-of-experts layers whose router and experts carry biases, with a clamped SwiGLU."""

from titan_exp.models.family import ModelFamily
from titan_exp.models.gpt_oss.config import GptOssConfig
from titan_exp.models.gpt_oss.hf_format import GptOssFormat

FAMILY = ModelFamily("gpt_oss", GptOssConfig, "titan_exp.models.gpt_oss.model:GptOss", GptOssFormat())

"""DeepSeek-V3 (and the 16B flavor's V2-Lite shape): multi-head latent attention, YaRN, MoE layers
after dense ones with shared experts and grouped sigmoid routing."""

from titan_exp.models.deepseek_v3.config import DeepSeekV3Config
from titan_exp.models.deepseek_v3.hf_format import DeepSeekV3Format
from titan_exp.models.family import ModelFamily

FAMILY = ModelFamily(
    "deepseek_v3", DeepSeekV3Config, "titan_exp.models.deepseek_v3.model:DeepSeekV3", DeepSeekV3Format()
)

"""Llama 3 (Meta's Llama 3, 3.1 and 3.2): grouped-query attention, SwiGLU, Llama 3.1's rotary scaling."""

from titan_exp.models.family import ModelFamily
from titan_exp.models.llama3.config import Llama3Config
from titan_exp.models.llama3.hf_format import LlamaFormat

FAMILY = ModelFamily("llama3", Llama3Config, "titan_exp.models.llama3.model:Llama3", LlamaFormat())

"""Llama 3's `model` section: the shared one as it is (grouped-query attention, SwiGLU, Llama 3.1's
rotary scaling); its own rules and figures would go here."""

from dataclasses import dataclass

from titan_exp.models.config import ModelConfig


@dataclass
class Llama3Config(ModelConfig):
    pass

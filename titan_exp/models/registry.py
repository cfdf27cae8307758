"""The model families, one line each: a family is its folder under models/ (its FAMILY record,
models/family.py) and the option YAMLs of conf/model/ that name it. Torch-free."""

from typing import TYPE_CHECKING

from titan_exp.models import deepseek_v3, gpt_oss, llama3, qwen3
from titan_exp.models.config import ModelConfig
from titan_exp.models.family import ModelFamily
from titan_exp.models.hf import CONFIG_FILE, hf_value, read_hf_config, refusing
from titan_exp.rules import ConfigError

if TYPE_CHECKING:  # torch: imported where the model is built
    from titan_exp.models.common.transformer import Transformer

FAMILIES: dict[str, ModelFamily] = {
    family.name: family
    for family in (
        llama3.FAMILY,
        qwen3.FAMILY,
        deepseek_v3.FAMILY,
        gpt_oss.FAMILY,
    )
}


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family of a resolved model section (its `name`)."""
    return FAMILIES[cfg.name]


def build_model(cfg: ModelConfig) -> "Transformer":
    """The whole model of a model section, its family's (on the current default device)."""
    return family_of(cfg).build(cfg)


def config_from_hf(folder: str, key: str) -> ModelConfig:
    """The model section of a Hugging Face model folder: its family from config.json's model_type,
    every shape field from the rest; `key` named the folder (a refusal names it)."""
    hf = read_hf_config(folder, key)
    refuse = refusing(key, folder)
    family = _reader(hf, refuse)
    cfg = family.config(name=family.name, hf_path=folder, **family.hf.fields_from_hf(hf, refuse))
    try:  # the shape rules (absurd sizes among them) before anything walks the layers
        cfg.check("model")
    except ConfigError as err:
        raise ConfigError(key, folder, f"its {CONFIG_FILE} makes {err}") from None
    return cfg


def hf_cautions(folder: str) -> list[str]:
    """What of the Hugging Face folder (model=hf's) is not read, in its family's words."""
    hf = read_hf_config(folder, "model.hf_path")
    return _reader(hf, refusing("model.hf_path", folder)).hf.cautions(hf)


def _reader(hf: dict, refuse) -> ModelFamily:
    """The family that reads a config.json, by its model_type."""
    model_type = hf_value(hf, "model_type", str, refuse, None)
    readers = {t: family for family in FAMILIES.values() if family.hf for t in family.hf.model_types}
    if model_type not in readers:
        known = ", ".join(f"{t} ({family.name})" for t, family in readers.items())
        raise refuse(f"model_type={model_type}; the {CONFIG_FILE} model types read here: {known}")
    return readers[model_type]

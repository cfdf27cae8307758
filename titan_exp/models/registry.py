"""The model families, one line each: a family is its folder under models/ (its FAMILY record,
models/family.py) and the option YAMLs of conf/model/ that name it. Torch-free."""

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

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


# The option that takes the model from a Hugging Face folder (conf/model/hf.yaml), and its `name`
# until the folder's config.json says which family it is.
HF_OPTION = "hf"


@dataclass
class HFFolderConfig(*(family.config for family in FAMILIES.values())):
    """model=hf's section until its folder is read (config/resolve.py): every family's keys, so that
    any of them may be set beside model=hf; the folder's family must then have it."""

    # The keys (dotted, under `model.`) set beside model=hf, on the command line or in an
    # experiment (config/compose.py finds them): they apply over the folder's config.json. Not a
    # config key: an attribute of the composed section only.
    keys_set: ClassVar[tuple[str, ...]] = ()


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family of a resolved model section (its `name`)."""
    return FAMILIES[cfg.name]


def build_model(cfg: ModelConfig) -> "Transformer":
    """The whole model of a model section, its family's (on the current default device)."""
    return family_of(cfg).build(cfg)


def config_from_hf(folder: str, key: str, keys_set: Mapping[str, object] | None = None) -> ModelConfig:
    """The model section of a Hugging Face model folder: its family from config.json's model_type,
    every field it gives from the rest, then `keys_set` (dotted keys under `model.` and their
    values) over them (_over_the_folder). `key` named the folder (a refusal of the folder names it)."""
    hf = read_hf_config(folder, key)
    refuse = refusing(key, folder)
    family = _reader(hf, refuse)
    cfg = family.config(name=family.name, hf_path=folder, **family.hf.fields_from_hf(hf, refuse))
    try:  # the shape rules (absurd sizes among them) before anything walks the layers
        cfg.check("model")
    except ConfigError as err:
        raise ConfigError(key, folder, f"its {CONFIG_FILE} makes {err}") from None
    return _over_the_folder(cfg, family, folder, keys_set) if keys_set else cfg


def _over_the_folder(theirs: ModelConfig, family: ModelFamily, folder: str, keys_set: Mapping) -> ModelConfig:
    """The folder's section `theirs` with `keys_set` over it, checked together. A key the family
    lacks is refused, and so is one that would change a weight's shape (the weights are the
    folder's) or make a model the folder's format cannot hold (its architecture is the folder's),
    naming the folder's value."""
    ours, given = copy.deepcopy(theirs), {}
    for name, value in keys_set.items():
        owner, leaf = _field_of(ours, name, family, folder, value)
        if getattr(owner, leaf) != value:
            given[name] = getattr(owner, leaf)
            setattr(owner, leaf, value)
    ours.check("model")  # every key's rules, on the keys as they are set together
    shapes, held = family.hf.weight_shapes(theirs), family.hf.refusal(theirs) is None

    def not_the_folders(changed: ModelConfig) -> str | None:
        if family.hf.weight_shapes(changed) != shapes:
            return "the weights' shapes are the folder's"
        why = family.hf.refusal(changed) if held else None
        return f"its format holds no other ({why})" if why else None

    if (why := not_the_folders(ours)) is None:
        return ours
    for name, value in given.items():  # the one key to drop, where one alone does it
        alone = copy.deepcopy(theirs)
        setattr(*_field_of(alone, name, family, folder, keys_set[name]), keys_set[name])
        if (why_alone := not_the_folders(alone)) is not None:
            raise ConfigError(
                f"model.{name}", keys_set[name], f"drop it: {folder}'s {CONFIG_FILE} gives {value}, and {why_alone}"
            )
    names = ", ".join(f"model.{name}" for name in given)  # only together are they not the folder's
    values = ", ".join(str(keys_set[name]) for name in given)
    folders = ", ".join(str(value) for value in given.values())
    raise ConfigError(names, values, f"drop them: {folder}'s {CONFIG_FILE} gives {folders}, and {why}")


def _field_of(cfg: ModelConfig, name: str, family: ModelFamily, folder: str, value: object) -> tuple[object, str]:
    """(the section that holds the dotted key `name` of `cfg`, the key's last part); a key the
    family's section lacks (another family's) is refused."""
    *sections, leaf = name.split(".")
    owner = cfg
    for section in sections:
        owner = getattr(owner, section, None)
    fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set()
    if leaf not in fields or dataclasses.is_dataclass(getattr(owner, leaf)):
        raise ConfigError(f"model.{name}", value, f"is not a key of {family.name} models, which {folder} holds")
    return owner, leaf


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

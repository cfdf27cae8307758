"""From Hydra's composed config to the typed one: keys the schema does not know are refused rather
than dropped, then the DictConfig becomes a JobConfig."""

import dataclasses
import typing

from omegaconf import DictConfig, OmegaConf

from titan_exp.config.schema import JobConfig
from titan_exp.rules import ConfigError


def to_job_config(composed: DictConfig) -> JobConfig:
    """`composed`: the task's config (Hydra's own `hydra` node left out)."""
    check_known_keys(OmegaConf.to_container(composed, resolve=True), JobConfig)
    return OmegaConf.to_object(composed)


def check_known_keys(tree: dict, schema: type, prefix: str = "") -> None:
    """Every key of the composed config is one of the schema's: Hydra lets `+section.key=value` add
    any key, which the typed config would then drop without a word. Free-form dicts (such as
    launcher.additional_parameters) take any key."""
    fields = typing.get_type_hints(schema)
    for key, value in tree.items():
        if key not in fields:
            raise ConfigError(
                f"{prefix}{key}", value, "is not a key of the config; check its spelling (--cfg job lists the keys)"
            )
        if dataclasses.is_dataclass(fields[key]) and isinstance(value, dict):
            check_known_keys(value, fields[key], f"{prefix}{key}.")

"""From Hydra's composed config to the typed one: keys the schema does not know are refused rather
than dropped, and so are command-line values of keys that only label (rules.label); then the
DictConfig becomes a JobConfig."""

import dataclasses
import difflib
import typing
from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from titan_exp import CONF_DIR
from titan_exp.config.schema import JobConfig, register_schema
from titan_exp.config.tree import group_options
from titan_exp.rules import ConfigError


def to_job_config(composed: DictConfig, overrides: Sequence[str] = ()) -> JobConfig:
    """`composed`: the task's config (Hydra's own `hydra` node left out); `overrides`: the
    command line's, as Hydra recorded them (hydra.overrides.task)."""
    check_label_overrides(overrides)
    check_known_keys(OmegaConf.to_container(composed, resolve=True), JobConfig)
    return OmegaConf.to_object(composed)


def compose_job_config(overrides: Sequence[str]) -> JobConfig:
    """The job config for `overrides`, composed as the command line does (Hydra's compose API;
    Hydra's own keys, which place a run's outputs, are left out)."""
    from hydra import compose, initialize_config_dir

    register_schema()
    overrides = [override for override in overrides if not override.startswith("hydra.")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_job_config(compose(config_name="config", overrides=overrides), overrides)


def check_label_overrides(overrides: Sequence[str]) -> None:
    """A label set by hand would name the run after something it is not (model.flavor=8b on the
    debug model): the option that sets it is the choice."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        section, _, name = key.partition(".")
        fields = {f.name: f for f in dataclasses.fields(JobConfig)}
        if section not in fields or not dataclasses.is_dataclass(fields[section].default_factory):
            continue
        field = next((f for f in dataclasses.fields(fields[section].default_factory) if f.name == name), None)
        if field is not None and "chosen_by" in field.metadata:
            options = ", ".join(group_options().get(section, []))
            raise ConfigError(
                key,
                value,
                f"only labels the run (the option file sets it); choose with {field.metadata['chosen_by']} "
                f"({section} options: {options}); name a run with tracking.run_name",
            )


def check_known_keys(tree: dict, schema: type, prefix: str = "") -> None:
    """Every key of the composed config is one of the schema's: Hydra lets `+section.key=value` add
    any key, which the typed config would then drop without a word. Free-form dicts (such as
    launcher.additional_parameters) take any key."""
    fields = typing.get_type_hints(schema)
    for key, value in tree.items():
        if key not in fields:
            raise ConfigError(f"{prefix}{key}", value, unknown_key_fix(f"{prefix}{key}"))
        if dataclasses.is_dataclass(fields[key]) and isinstance(value, dict):
            check_known_keys(value, fields[key], f"{prefix}{key}.")


def schema_keys(schema: type = JobConfig, prefix: str = "") -> list[str]:
    """Every key of the schema, dotted (training.steps, ...)."""
    keys = []
    for name, kind in typing.get_type_hints(schema).items():
        if dataclasses.is_dataclass(kind):
            keys += schema_keys(kind, f"{prefix}{name}.")
        elif not name.startswith("_"):
            keys.append(f"{prefix}{name}")
    return keys


def unknown_key_fix(key: str) -> str:
    """What to say of a key the schema lacks: the closest known key (a typo in the name or the
    section, or the right name in the wrong section), or where the keys are listed."""
    keys = schema_keys()
    section, _, leaf = key.rpartition(".")
    names_in_section = [known.rpartition(".")[2] for known in keys if known.rpartition(".")[0] == section]
    close = [f"{section}.{name}" for name in difflib.get_close_matches(leaf, names_in_section, n=1, cutoff=0.7)]
    close = close or [known for known in keys if known.rpartition(".")[2] == leaf][:1]
    close = close or difflib.get_close_matches(key, keys, n=1, cutoff=0.85)
    hint = f"did you mean {close[0]}?" if close else "titan_exp --help lists the most used keys, --cfg job all"
    return f"is not a key of the config; {hint}"

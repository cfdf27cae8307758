"""From Hydra's composed config to the typed one: keys the schema does not know are refused rather
than dropped, and so are command-line values of keys that only label (rules.label); then the
DictConfig becomes a JobConfig, its model=hf section told which keys were set beside the option."""

import dataclasses
import difflib
import typing
from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from titan_exp import CONF_DIR
from titan_exp.config.schema import JobConfig, option_schemas, register_schema
from titan_exp.config.tree import group_options, option_picked, option_schema, option_values
from titan_exp.models.registry import HFFolderConfig
from titan_exp.rules import ConfigError, dotted_keys


def to_job_config(composed: DictConfig, overrides: Sequence[str] = ()) -> JobConfig:
    """`composed`: the task's config (Hydra's own `hydra` node left out); `overrides`: the
    command line's, as Hydra recorded them (hydra.overrides.task)."""
    check_label_overrides(overrides)
    check_known_keys(composed)
    cfg = OmegaConf.to_object(composed)
    if isinstance(cfg.model, HFFolderConfig):
        cfg.model.keys_set = model_keys_set(composed.model, overrides)
    return cfg


# Keys of a model=hf section that are never applied over the folder: the labels and the folder itself.
_NOT_OVER_THE_FOLDER = ("name", "flavor", "hf_path")


def model_keys_set(model: DictConfig, overrides: Sequence[str]) -> tuple[str, ...]:
    """The keys (dotted, under `model.`) of a model=hf section set beside the option: those the
    command line names, those the files it chooses set (the experiment's `model:` keys, the model
    option's own), and any other the composition holds at other than the schema's default (a file
    these miss). Each applies over the folder's config.json (models/registry.config_from_hf)."""
    values = dotted_keys(OmegaConf.to_container(model))
    defaults = dotted_keys(OmegaConf.to_container(OmegaConf.structured(HFFolderConfig)))
    named = [key.removeprefix("model.") for key, _ in _override_pairs(overrides) if key.startswith("model.")]
    named += _model_keys_in_files(overrides)
    keys_set = {key for key in values if any(key == n or key.startswith(f"{n}.") for n in named)}
    keys_set |= {key for key, value in values.items() if value != defaults.get(key)}
    return tuple(sorted(keys_set - set(_NOT_OVER_THE_FOLDER)))


def _override_pairs(overrides: Sequence[str]) -> list[tuple[str, str]]:
    """(key, value) of each of a command line's overrides (Hydra's `+key=`, `++key=` and `~key`
    forms alike)."""
    return [(key, value) for key, _, value in (override.lstrip("+~").partition("=") for override in overrides)]


def _model_keys_in_files(overrides: Sequence[str]) -> list[str]:
    """The model keys the option files the command line chooses set: its experiment's (`model:`)
    and its model option's, or the one the experiment picks."""
    chosen = dict(_override_pairs(overrides))
    experiment, model = chosen.get("experiment"), chosen.get("model")
    in_experiment = option_values("experiment", experiment).get("model") if experiment else None
    keys = list(dotted_keys(in_experiment)) if isinstance(in_experiment, dict) else []
    model = model or (option_picked("experiment", experiment, "model") if experiment else None)
    return keys + (list(dotted_keys(option_values("model", model))) if model else [])


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
    for key, value in _override_pairs(overrides):
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


def check_known_keys(node: DictConfig, prefix: str = "") -> None:
    """Every key of the composed config is one of its schema's (a section's, or the subclass its
    option chose: config/schema.py's option_schemas): Hydra lets `+section.key=value` add any key,
    which the typed config would then drop without a word. Free-form dicts (such as
    launcher.additional_parameters) take any key."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    fields = typing.get_type_hints(schema)
    for key in node:
        if key not in fields:
            raise ConfigError(f"{prefix}{key}", OmegaConf.to_container(node)[key], unknown_key_fix(f"{prefix}{key}"))
        value = node._get_node(key)
        if isinstance(value, DictConfig):
            check_known_keys(value, f"{prefix}{key}.")


def schema_keys(schema: type = JobConfig, prefix: str = "") -> list[str]:
    """Every key of the schema, dotted (training.steps, ...), those of the groups' option schemas
    included (a key of one model family's section is a key of its options)."""
    keys = []
    for name, kind in typing.get_type_hints(schema).items():
        if dataclasses.is_dataclass(kind):
            for subclass in [kind, *option_schemas().get(name, {}).values()] if not prefix else [kind]:
                keys += schema_keys(subclass, f"{prefix}{name}.")
        elif not name.startswith("_"):
            keys.append(f"{prefix}{name}")
    return list(dict.fromkeys(keys))


def options_reading(key: str) -> list[str]:
    """The options of `key`'s group whose schema has `key` where the group's own section lacks it
    (a key of one model family's section: that family's options); empty for a key of the section itself."""
    group = key.partition(".")[0]

    def has(schema: type) -> bool:  # the key itself, or a section of keys under it
        return any(known == key or known.startswith(f"{key}.") for known in schema_keys(schema, f"{group}."))

    section = next((f.default_factory for f in dataclasses.fields(JobConfig) if f.name == group), None)
    if section is None or has(section):
        return []
    names = [name for name, schema in option_schemas().get(group, {}).items() if has(schema)]
    return [option for option in group_options().get(group, []) if option_schema(group, option) in names]


def unknown_key_fix(key: str) -> str:
    """What to say of a key the schema lacks (see key_hint)."""
    hint = key_hint(key)
    return hint if options_reading(key) else f"is not a key of the config; {hint}"


def key_hint(key: str) -> str:
    """Where a key the config lacks is found: the options of its group that read it, else the
    closest known key (a typo in the name or the section, or the right name in the wrong section),
    else where the keys are listed."""
    if readers := options_reading(key):
        return f"is read by {key.partition('.')[0]}={'|'.join(readers)} only; choose one of them"
    keys = schema_keys()
    section, _, leaf = key.rpartition(".")
    names_in_section = [known.rpartition(".")[2] for known in keys if known.rpartition(".")[0] == section]
    close = [f"{section}.{name}" for name in difflib.get_close_matches(leaf, names_in_section, n=1, cutoff=0.7)]
    close = close or [known for known in keys if known.rpartition(".")[2] == leaf][:1]
    close = close or difflib.get_close_matches(key, keys, n=1, cutoff=0.85)
    return f"did you mean {close[0]}?" if close else "titan_exp --help lists the most used keys, --cfg job all"

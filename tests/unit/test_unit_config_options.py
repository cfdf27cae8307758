"""Every option of every config group, and every experiment preset, composes through Hydra's compose
API into the typed JobConfig (config/compose.py's to_job_config), and what the option file says is
what lands in its section. Groups and options are read from titan_exp/conf/ at collection time."""

import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from titan_exp.config.compose import to_job_config
from titan_exp.config.schema import JobConfig, option_schemas
from titan_exp.config.tree import option_schema

from conftest import CONF_DIR, compose_config

PRESETS = "experiment"
GROUPS = sorted(
    p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != PRESETS and not p.name.startswith("hydra")
)
OPTIONS = [(group, p.stem) for group in GROUPS for p in sorted((CONF_DIR / group).glob("*.yaml"))]
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / PRESETS).glob("*.yaml"))


@functools.cache
def composed(*overrides: str) -> JobConfig:
    """The typed config of `overrides` (each composed once per session: composing takes ~0.1 s)."""
    return to_job_config(compose_config(list(overrides)))


def option_values(group: str, option: str) -> dict[str, Any]:
    """What titan_exp/conf/<group>/<option>.yaml sets (a comment-only file sets nothing; its
    defaults list names its schema)."""
    loaded = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
    values = OmegaConf.to_container(loaded) if loaded else {}
    values.pop("defaults", None)
    return values


def schema_default(group: str, option: str | None = None) -> Any:
    """The section's value in a JobConfig built from the schema alone (for `option`: from the
    schema it names, a subclass of the section's)."""
    schema = option_schema(group, option) if option else None
    return option_schemas()[group][schema]() if schema else getattr(JobConfig(), group)


def test_conf_has_groups_options_and_presets() -> None:
    """The filesystem listing found what the parametrized tests below run over."""
    assert {"model", "parallelism", "hardware", "training"} <= set(GROUPS)
    assert all(any(g == group for g, _ in OPTIONS) for group in GROUPS)
    assert EXPERIMENTS


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_is_a_section_of_the_job_config(group: str) -> None:
    assert group in {f.name for f in dataclasses.fields(JobConfig)}
    assert dataclasses.is_dataclass(schema_default(group))


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_into_its_section(group: str, option: str) -> None:
    """The section is the schema's default with exactly the option file's values on top (so its
    `name`, where it sets one, is the typed section's name)."""
    section = getattr(composed(f"{group}={option}"), group)
    values = option_values(group, option)
    assert section == with_values(schema_default(group, option), values)
    if "name" in values:
        assert section.name == values["name"]


def with_values(default: object, values: dict) -> object:
    """`default` with `values` on top, a nested section's (model.moe) merged into its own default."""
    changes = {
        key: with_values(getattr(default, key), value) if dataclasses.is_dataclass(getattr(default, key)) else value
        for key, value in values.items()
    }
    return dataclasses.replace(default, **changes)


@pytest.mark.parametrize("group", [g for g in GROUPS if sum(o[0] == g for o in OPTIONS) > 1])
def test_options_of_a_group_compose_to_different_sections(group: str) -> None:
    """No two options of a group are the same configuration."""
    options = [o for g, o in OPTIONS if g == group]
    sections = [getattr(composed(f"{group}={o}"), group) for o in options]
    duplicates = [
        (a, b) for i, a in enumerate(options) for j, b in enumerate(options) if i < j and sections[i] == sections[j]
    ]
    assert not duplicates


def _preset(name: str) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """(group → option the preset selects with `override /group: option`, section → its own values),
    over those of a preset it builds on (a plain name in its defaults: loss_parity_moe's loss_parity)."""
    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / PRESETS / f"{name}.yaml"))
    selected, own = {}, {}
    for entry in raw.pop("defaults", []):
        if isinstance(entry, dict):
            for key, option in entry.items():
                selected[key.removeprefix("override").strip().lstrip("/")] = option
        elif entry != "_self_":
            base_selected, own = _preset(entry)
            selected = base_selected | selected
    for section, values in raw.items():
        own[section] = OmegaConf.to_container(OmegaConf.merge(own.get(section, {}), values))
    return selected, own


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_preset_composes(name: str) -> None:
    """The groups the preset overrides hold the selected option (with the preset's own values on
    top: its _self_ comes last), and every other value it sets lands where it says."""
    job = composed(f"{PRESETS}={name}")
    selected, own = _preset(name)
    for group, option in selected.items():
        values = OmegaConf.to_container(OmegaConf.merge(option_values(group, option), own.pop(group, {})))
        assert getattr(job, group) == with_values(schema_default(group, option), values), group
    for section, values in own.items():
        for key, value in values.items():
            assert getattr(getattr(job, section), key) == value, f"{section}.{key}"


def test_preset_overrides_reach_past_the_primary_defaults() -> None:
    """llama3_8b_fsdp replaces the primary config's debug model (a check that the preset test above
    is not comparing defaults with defaults)."""
    if "llama3_8b_fsdp" not in EXPERIMENTS:
        pytest.skip("preset llama3_8b_fsdp is gone")
    default, preset = composed(), composed(f"{PRESETS}=llama3_8b_fsdp")
    assert (default.model.flavor, preset.model.flavor) == ("debug", "8b")
    assert preset.model.n_layers == 32 and Path(CONF_DIR / "model" / "llama3_8b.yaml").exists()

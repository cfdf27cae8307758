"""An option file says only what its option changes: every key of titan_exp/conf/<group>/<option>.yaml is a
field of the group's schema dataclass (titan_exp/config/schema.py, JobConfig) and differs from that
field's default. Presets (titan_exp/conf/experiment, `# @package _global_`) are exempt."""

import dataclasses
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from titan_exp.config.schema import JobConfig, option_schemas
from titan_exp.config.tree import option_schema

from conftest import CONF_DIR

EXEMPT_GROUPS = {"experiment"}

# Each section of the job config that has a dataclass type, by its key in JobConfig.
SECTIONS = {name: hint for name, hint in typing.get_type_hints(JobConfig).items() if dataclasses.is_dataclass(hint)}
GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in EXEMPT_GROUPS)


def defaults(section: type) -> dict[str, typing.Any]:
    """Each field's default, as a plain value (a default_factory's product for lists and dicts)."""
    values = {}
    for f in dataclasses.fields(section):
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
    return values


def option_files() -> list[Path]:
    return [path for group in GROUPS for path in sorted((CONF_DIR / group).glob("*.yaml"))]


def test_every_group_is_a_section_of_the_job_config():
    assert GROUPS and set(GROUPS) <= set(SECTIONS), sorted(set(GROUPS) - set(SECTIONS))


@pytest.mark.parametrize("path", option_files(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_option_file_sets_only_fields_that_differ_from_the_defaults(path: Path):
    group = path.parent.name
    schema = option_schema(group, path.stem)
    section = option_schemas()[group][schema] if schema else SECTIONS[group]
    loaded = OmegaConf.load(path)
    values = OmegaConf.to_container(loaded) if loaded else {}  # a comment-only file loads as empty
    assert isinstance(values, dict), f"{path} does not hold a mapping"
    values.pop("defaults", None)  # names its schema
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(section)})
    assert not unknown, f"{path}: not fields of {section.__name__}: {unknown}"
    default = defaults(section)
    same = [f"{key}: {value!r}" for key, value in values.items() if key in default and value == default[key]]
    assert not same, f"{path} repeats {section.__name__}'s defaults; remove: {', '.join(same)}"

"""The user's own device profiles (<user config folder>/hardware/<name>.yaml: what `titan_exp plan
calibrate` writes, or a teammate's copy), read as data: a small regular UTF-8 file of plain YAML
(titan_exp/untrusted.py), each key one of HardwareConfig's with a value of its type and in its
range, under the `hardware` package only (hydra_plugins/titan_exp_user_conf registers them; Hydra
never reads the files itself, so no `# @package`, defaults list or interpolation in one can reach
the rest of the job). Each refusal is a ValueError of one line naming the file. Torch-free."""

import re
import typing
from pathlib import Path

from titan_exp import user_conf_dir
from titan_exp.estimate.config import HardwareConfig
from titan_exp.estimate.hardware_profiles import hardware_profiles
from titan_exp.rules import ConfigError
from titan_exp.untrusted import plain_yaml, read_text

# A profile is some twenty lines (a shipped one with its comments: 1.5 kB).
MAX_PROFILE_BYTES = 64 << 10
# A mapping of figures, one of which is a list (device_names).
_DEPTH = 2
# What `hardware=<name>` can name and a file name can hold: one path component.
NAME_RULE = "1-100 letters, digits, _ . or - (one file name, not starting with .)"
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}")
# Hydra's header line that moves a config file's keys elsewhere (`# @package _global_`).
_PACKAGE = re.compile(r"^\s*#\s*@package", re.MULTILINE)
_FIELDS = typing.get_type_hints(HardwareConfig)


def is_profile_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def profiles_folder() -> Path:
    return user_conf_dir() / "hardware"


def user_profiles() -> dict[str, dict]:
    """Each profile of the user's folder by its option name: the values its file sets, checked.
    Files whose names start with a dot (an editor's) are no options; any other that is not a good
    profile is refused."""
    folder = profiles_folder()
    if not folder.is_dir():
        return {}
    return {
        path.stem: read_profile(path)
        for path in sorted(folder.iterdir())
        if path.suffix == ".yaml" and not path.name.startswith(".")
    }


def read_profile(path: Path) -> dict:
    """The values a profile file sets (its `name` filled in where it leaves it out), each checked."""
    name = path.stem
    if not is_profile_name(name):
        raise ValueError(f"{path}: {name!r} cannot be an option of hardware; rename the file: {NAME_RULE}")
    if name in hardware_profiles():
        raise ValueError(
            f"{path}: titan_exp ships a profile named {name}, which hardware={name} composes; "
            f"rename yours (the file and its name:), e.g. {name}_ours"
        )
    text = read_text(path, MAX_PROFILE_BYTES)
    if _PACKAGE.search(text):
        raise ValueError(f"{path}: a `# @package` line; a profile sets hardware's keys only: remove the line")
    values = plain_yaml(text, str(path), _DEPTH) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path} holds a {type(values).__name__}, not a table of hardware's keys")
    values.setdefault("name", name)
    try:
        for key, value in values.items():
            _check_type(key, value)
        if values["name"] != name:
            raise ConfigError(
                "hardware.name", values["name"], f"must be the file's name, {name}, as hardware= names it"
            )
        HardwareConfig(**values).check("hardware")
    except ConfigError as err:
        raise ValueError(f"{path}: {err}") from None
    return values


def _check_type(key: object, value: object) -> None:
    """`value` has the type HardwareConfig gives `key` (an int is a float too; a bool is no number),
    and text is one line of plain characters, neither an interpolation (`${...}`) nor OmegaConf's
    missing value (`???`)."""
    if key not in _FIELDS:
        raise ConfigError(f"hardware.{key}", repr(value), "is not a key of a device profile; remove it")
    kind = _FIELDS[key]
    texts = value if kind == list[str] and isinstance(value, list) else [value]
    if kind is float:
        fits = type(value) in (int, float)
    elif kind in (int, bool, str):
        fits = type(value) is kind
    else:  # list[str]
        fits = isinstance(value, list) and all(type(text) is str for text in value)
    if not fits:
        raise ConfigError(f"hardware.{key}", repr(value), f"must be {_KINDS[kind]}")
    if any(isinstance(text, str) and ("${" in text or text == "???" or not text.isprintable()) for text in texts):
        raise ConfigError(f"hardware.{key}", repr(value), "must be plain text: no ${...}, ??? or control characters")


_KINDS = {float: "a number", int: "a whole number", bool: "true or false", str: "text", list[str]: "a list of texts"}

"""The words every config section's rules are written in: ConfigError (the key, the value, the
fix: one line on the command line, exit 2), keys whose choices are declared once on the field
(`one_of`), and the few value checks the sections share.

Each section dataclass derives from `Section` and keeps its own rules in `check(key)`, next to its
fields; rules across sections are in config/check.py. Torch-free, and imported by every section:
it imports nothing of the project but the placement layer's error."""

import dataclasses
import math
from typing import Any

# The placement layer's words for a wrong option, shared: an engine's own rules raise the same error.
from launchers.base import ConfigError as ConfigError
from launchers.base import check_one_line as check_one_line


def one_of(*choices: Any, default: Any = None) -> Any:
    """A field whose value must be one of `choices` (the first is the default unless `default` is
    given). Section.check refuses anything else, naming the choices."""
    return dataclasses.field(default=choices[0] if default is None else default, metadata={"choices": choices})


def label(default: str, chosen_by: str) -> Any:
    """A field that names what an option file chose and selects nothing itself (a model's flavor):
    the option file sets it; set on the command line it would only mislabel the run, so it is
    refused there (config/compose.py), pointing to `chosen_by`, the way to choose."""
    return dataclasses.field(default=default, metadata={"chosen_by": chosen_by})


def torchtitan_name(of: str) -> Any:
    """A key under the name torchtitan gives it today, accepted beside ours (`of`, the key it sets)
    so that its flags paste as they are; config/aliases.py turns its value into ours (tokens into
    sequences where the units differ) before anything is checked. None: not given."""
    return dataclasses.field(default=None, metadata={"alias_of": of})


def choices(section: type, name: str) -> tuple:
    """The choices `one_of` declared for a field of a section class."""
    return next(f.metadata["choices"] for f in dataclasses.fields(section) if f.name == name)


def check_choice(key: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(key, value, f"choose one of {', '.join(map(str, allowed))}")


def check_positive(key: str, value: int | float) -> None:
    if not value > 0 or math.isinf(value):  # `not >` also refuses nan
        raise ConfigError(key, value, "must be > 0" if isinstance(value, int) else "must be a finite number > 0")


def check_at_least(key: str, value: int | float, low: int | float) -> None:
    if not value >= low:  # also refuses nan
        raise ConfigError(key, value, f"must be >= {low}")


def check_in_range(key: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:  # also refuses nan
        raise ConfigError(key, value, f"must lie in [{low:g}, {high:g}]")


def check_folder_name(key: str, name: str) -> None:
    """A name that becomes one folder's name: nothing that could leave the parent folder, and short
    enough for any file system (255 bytes a component)."""
    check_one_line(key, name)
    if not name or name in (".", "..") or "/" in name or "\\" in name or len(name.encode()) > 200:
        raise ConfigError(key, repr(name), "must be 1-200 bytes without / or \\ and not . or .., e.g. titan_exp")


def check_count_or_auto(key: str, value: int, auto: str) -> None:
    """A positive count, or -1 for `auto`."""
    if value == 0 or value < -1:
        raise ConfigError(key, value, f"must be a positive count or -1 ({auto})")


class Section:
    """Base of the config sections: `check` validates the declared choices (a section adds its own
    rules by extending it), and a resolved job's sections are frozen (`freeze`), so that nothing
    downstream of the resolution changes what was resolved."""

    _frozen = False

    def check(self, key: str) -> None:
        """Refuse values this section alone can tell are wrong; `key`: the section's name in the config."""
        for f in dataclasses.fields(self):
            if "choices" in f.metadata:
                check_choice(f"{key}.{f.name}", getattr(self, f.name), f.metadata["choices"])

    def freeze(self) -> None:
        for f in dataclasses.fields(self):
            if isinstance(value := getattr(self, f.name), Section):
                value.freeze()
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name: str, value: object) -> None:
        if self._frozen:
            raise dataclasses.FrozenInstanceError(
                f"{type(self).__name__}.{name}: a resolved job is frozen; derive a new one (dataclasses.replace)"
            )
        object.__setattr__(self, name, value)


def dotted_keys(tree: dict, prefix: str = "") -> dict[str, object]:
    """A nested section as its dotted keys and their values ({"moe": {"top_k": 2}} → {"moe.top_k": 2}),
    as the command line and MLflow's params name them."""
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(dotted_keys(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat

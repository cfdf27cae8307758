"""The config tree on disk (titan_exp/conf/, then the user's folder: titan_exp.user_conf_dir()): its
groups, their options and the defaults config.yaml picks, read without composing anything. Torch-free."""

from pathlib import Path

from omegaconf import OmegaConf

from titan_exp import CONF_DIR, user_conf_dir
from titan_exp.estimate.user_profiles import profiles_folder, read_profile

# Groups whose options are not picked one at a time (Hydra's own).
HIDDEN_GROUPS = ("hydra",)


def group_options() -> dict[str, list[str]]:
    """Every config group and its options: the shipped ones and, in a group the project ships, the
    user's own (as Hydra's search path finds them: hydra_plugins/titan_exp_user_conf)."""
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in HIDDEN_GROUPS)
    return {
        group: sorted({option.stem for folder in _folders() for option in (folder / group).glob("*.yaml")})
        for group in groups
    }


def _folders() -> list[Path]:
    return [CONF_DIR, user_conf_dir()]


def _option_file(group: str, option: str) -> Path:
    """The file Hydra composes for `group=option`: the shipped one first, as on its search path."""
    return next(
        (f for folder in _folders() if (f := folder / group / f"{option}.yaml").is_file()),
        CONF_DIR / group / f"{option}.yaml",
    )


def default_options() -> dict[str, str]:
    """The option config.yaml picks for each group (a group it leaves empty is absent)."""
    picked: dict[str, str] = {}
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["defaults"]:
        if isinstance(entry, dict):
            picked.update({group: option for group, option in entry.items() if option is not None})
    return picked


def option_schema(group: str, option: str) -> str | None:
    """The schema an option builds on (`- /<group>_schema/<name>@_here_` in its defaults list:
    config/schema.py's option_schemas), None where it builds on its group's section alone."""
    marker = f"/{group}_schema/"
    for entry in _option(group, option).get("defaults", []):
        if isinstance(entry, str) and entry.startswith(marker):
            return entry.removeprefix(marker).partition("@")[0]
    return None


def option_values(group: str, option: str) -> dict:
    """What an option file sets, its defaults list left out ({} for an option not on disk)."""
    return {key: value for key, value in _option(group, option).items() if key != "defaults"}


def option_picked(group: str, option: str, picked_group: str) -> str | None:
    """The option of `picked_group` that an option's defaults list picks (`- override /model: hf`
    in an experiment), None where it picks none."""
    entries = _option(group, option).get("defaults", [])
    names = (f"/{picked_group}", f"override /{picked_group}", picked_group, f"override {picked_group}")
    return next((entry[n] for entry in entries if isinstance(entry, dict) for n in names if n in entry), None)


def _option(group: str, option: str) -> dict:
    """An option file's contents, its defaults list included ({} for an option not on disk, or empty)."""
    path = _option_file(group, option)
    if path.parent == profiles_folder():  # a user's device profile: data, read within bounds
        return read_profile(path)
    return (OmegaConf.to_container(OmegaConf.load(path)) or {}) if path.is_file() else {}

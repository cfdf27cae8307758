"""The config tree on disk (titan_exp/conf/): its groups, their options and the defaults
config.yaml picks, read without composing anything. Torch-free."""

from omegaconf import OmegaConf

from titan_exp import CONF_DIR

# Groups whose options are not picked one at a time (Hydra's own).
HIDDEN_GROUPS = ("hydra",)


def group_options() -> dict[str, list[str]]:
    """Every config group and its options."""
    groups = sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in HIDDEN_GROUPS)
    return {group.name: sorted(option.stem for option in group.glob("*.yaml")) for group in groups}


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
    entries = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml")).get("defaults", [])
    marker = f"/{group}_schema/"
    for entry in entries:
        if isinstance(entry, str) and entry.startswith(marker):
            return entry.removeprefix(marker).partition("@")[0]
    return None

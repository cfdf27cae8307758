"""The engines that place rank processes, one line each: an engine is one module of launchers/
(its Launcher and its options) and its option YAML in titan_exp/conf/launcher/."""

from launchers.base import Launcher
from launchers.local import LocalLauncher
from launchers.ray import RayLauncher
from launchers.slurm import SlurmLauncher

LAUNCHERS: dict[str, type[Launcher]] = {
    engine.name: engine
    for engine in (
        LocalLauncher,
        SlurmLauncher,
        RayLauncher,
    )
}


def environment_tags() -> dict[str, str]:
    """Every engine's run tags from the rank's environment (Launcher.environment_tags)."""
    return {key: value for engine in LAUNCHERS.values() for key, value in engine.environment_tags().items()}

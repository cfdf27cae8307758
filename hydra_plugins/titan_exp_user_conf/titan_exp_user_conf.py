"""Appends titan_exp.user_conf_dir() to the config search path where the folder exists (a missing
folder on the path would make Hydra warn on every compose), less its `hardware` folder: the user's
device profiles are read as data (estimate/user_profiles.py), all of them each time Hydra sets up
its search path, and offered from Hydra's ConfigStore under the `hardware` package; the first one
that is not a good profile stops the composition, named in one line."""

from hydra._internal.core_plugins import file_config_source  # Hydra's own reader of a config folder
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.core.object_type import ObjectType
from hydra.errors import SearchPathException
from hydra.plugins.config_source import ConfigLoadError, ConfigResult
from hydra.plugins.search_path_plugin import SearchPathPlugin

from titan_exp import user_conf_dir
from titan_exp.estimate.user_profiles import user_profiles

_PROFILES = "hardware"
# The profiles this process put in the ConfigStore: one deleted from the folder since is taken out.
_registered: set[str] = set()


class TitanExpUserConf(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        try:
            profiles = user_profiles()
        except ValueError as err:  # a Hydra error: the callers of a composition report those in one line
            raise SearchPathException(str(err)) from None
        store = ConfigStore.instance()
        for gone in _registered - profiles.keys():
            store.repo.get(_PROFILES, {}).pop(f"{gone}.yaml", None)
        for name, values in profiles.items():
            store.store(group=_PROFILES, name=name, node=values)
        _registered.clear()
        _registered.update(profiles)
        folder = user_conf_dir()
        if folder.is_dir():
            search_path.append(provider="titan_exp-user", path=f"{UserFolder.scheme()}://{folder}")


def _in_profiles(config_path: str) -> bool:
    return config_path.strip("/").partition("/")[0] == _PROFILES


class UserFolder(file_config_source.FileConfigSource):
    """The user's config folder as Hydra reads one, its `hardware` folder left out."""

    @staticmethod
    def scheme() -> str:
        return "titan-exp-user"

    def is_group(self, config_path: str) -> bool:
        return not _in_profiles(config_path) and super().is_group(config_path)

    def is_config(self, config_path: str) -> bool:
        return not _in_profiles(config_path) and super().is_config(config_path)

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        listed = [] if _in_profiles(config_path) else super().list(config_path, results_filter)
        return [entry for entry in listed if not _in_profiles(entry)]

    def load_config(self, config_path: str) -> ConfigResult:
        if _in_profiles(config_path):
            raise ConfigLoadError(f"{config_path}: the user's profiles are read as data, from the ConfigStore")
        return super().load_config(config_path)

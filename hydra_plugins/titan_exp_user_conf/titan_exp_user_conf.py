"""Appends titan_exp.user_conf_dir() to the config search path where the folder exists (a missing
folder on the path would make Hydra warn on every compose)."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from titan_exp import user_conf_dir


class TitanExpUserConf(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        folder = user_conf_dir()
        if folder.is_dir():
            search_path.append(provider="titan_exp-user", path=f"file://{folder}")

"""A function named by its module, imported where it is called: the launching process hands the
ranks their code without importing it (and what that code imports, such as torch)."""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entrypoint:
    # "package.module:function"
    target: str
    # Rebuilds what the function returns from plain data, checking it (raises TypeError or
    # ValueError), where an engine carries it back as JSON (launcher=ray: from a cluster, data
    # never unpickled). None: the plain data as it is.
    result: Callable[[Any], Any] | None = None

    def __call__(self, arg: Any) -> Any:
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)(arg)

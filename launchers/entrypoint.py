"""A function named by its module, imported where it is called: the launching process hands the
ranks their code without importing it (and what that code imports, such as torch)."""

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entrypoint:
    # "package.module:function"
    target: str

    def __call__(self, arg: Any) -> Any:
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)(arg)

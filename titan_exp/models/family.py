"""A model family as the rest of the project sees it (TorchTitan's ModelSpec, split at the torch
line): its `model` section (the schema of its options, with the figures the planner reads), its
Hugging Face format, and where its module lives. The record is torch-free, so the launching
process and the planner read it; the module is imported by whoever builds the model (the ranks,
a dry run, the planner's measurement). Each family's folder defines its record as FAMILY and
models/registry.py lists it: nothing outside the folder names the family."""

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan_exp.models.config import ModelConfig
from titan_exp.models.hf import HFFormat

if TYPE_CHECKING:  # torch: imported where the model is built
    from titan_exp.models.common.transformer import Transformer


@dataclass(frozen=True)
class ModelFamily:
    # The `name` its options set (conf/model/<name>_<flavor>.yaml).
    name: str
    config: type[ModelConfig]
    # "package.module:Class" of its module, a Transformer (models/common/transformer.py) that brings
    # its attention (and that attention's tensor-parallel plan).
    module: str
    # How its models look in Hugging Face's format; None: not read or written here yet.
    hf: HFFormat | None = None

    def model_class(self) -> type["Transformer"]:
        module, name = self.module.split(":")
        return getattr(importlib.import_module(module), name)

    def build(self, cfg: ModelConfig) -> "Transformer":
        """The whole model of `cfg` (on the current default device: meta for a parallel build)."""
        return self.model_class()(cfg)

"""The `quantize` config group: low-precision training of the Linear layers (torchao)."""

from dataclasses import dataclass, field


@dataclass
class QuantizeConfig:
    # none | float8 | mxfp8
    name: str = "none"
    # float8: tensorwise | rowwise (torchao's recipes)
    recipe: str = "tensorwise"
    # Linear layers left in high precision, by name (the output projection by default, as torchtitan).
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    # tensorwise with FSDP: all-gather the weights already in float8 (half the traffic of bf16).
    enable_fsdp_float8_all_gather: bool = False

    @property
    def low_precision(self) -> bool:
        return self.name != "none"

"""The `quantize` config group: low-precision training of the Linear layers (torchao)."""

from dataclasses import dataclass, field

from titan_exp.rules import ConfigError, Section, one_of


@dataclass
class QuantizeConfig(Section):
    name: str = one_of("none", "float8", "mxfp8")
    # float8: torchao's recipe; rowwise (one scale per row) is torchtitan's today, which dropped
    # tensorwise (one scale per tensor, kept here for its float8 FSDP all-gather and TP).
    recipe: str = one_of("rowwise", "tensorwise")
    # Linear layers left in high precision, by name (the output projection by default, as torchtitan).
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    # tensorwise with FSDP: all-gather the weights already in float8 (half the traffic of bf16).
    enable_fsdp_float8_all_gather: bool = False

    def check(self, key: str) -> None:
        super().check(key)
        if self.enable_fsdp_float8_all_gather and (self.name != "float8" or self.recipe != "tensorwise"):
            raise ConfigError(
                f"{key}.enable_fsdp_float8_all_gather",
                True,
                "works with quantize=float8 and quantize.recipe=tensorwise only",
            )

    @property
    def low_precision(self) -> bool:
        return self.name != "none"

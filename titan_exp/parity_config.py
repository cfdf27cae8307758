"""The `parity` section: a loss-parity comparison instead of one training job (experiment=loss_parity)."""

from dataclasses import dataclass, field


@dataclass
class ParityConfig:
    # Each entry: the overrides of one layout, e.g. "parallelism=fsdp launcher.nproc_per_node=2".
    # Empty: an ordinary training job. The first layout is the reference.
    layouts: list[str] = field(default_factory=list)
    # Largest relative deviation of a layout's loss from the reference's, at any step, that passes.
    rtol: float = 1e-4

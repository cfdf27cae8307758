"""Resolved parallel degrees: sizes and the names people and tables use for a layout. Torch-free,
so that checking a config, naming a run and placing a job stay fast; the device mesh built from
these degrees is in parallel/mesh.py."""

from dataclasses import dataclass

from titan_exp.parallel.config import ParallelismConfig

# Mesh dimension name for each degree key, outermost first (torchtitan's order).
MESH_DIMS = {
    "pipeline_parallel_degree": "pp",
    "data_parallel_replicate_degree": "dp_replicate",
    "data_parallel_shard_degree": "dp_shard",
    "context_parallel_degree": "cp",
    "tensor_parallel_degree": "tp",
}


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int

    @classmethod
    def from_config(cls, cfg: ParallelismConfig) -> "ParallelDims":
        """Build from degrees that have already been resolved (no -1 left; see config/resolve.py)."""
        return cls(**{MESH_DIMS[key]: degree for key, degree in cfg.degrees().items()})

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one batch; tokens/s per device divides by this (torchtitan's definition)."""
        return self.tp * self.pp * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled

    def mesh_shape(self) -> dict[str, int]:
        """Mesh dims of size > 1, outermost first."""
        return {name: getattr(self, name) for name in MESH_DIMS.values() if getattr(self, name) > 1}

    def describe(self) -> str:
        """Compact layout string such as 'dp_replicate2·dp_shard2' ('single' for one device)."""
        return "·".join(f"{name}{size}" for name, size in self.mesh_shape().items()) or "single"

    def label(self) -> str:
        """Layout in the words people use: 'fsdp8', 'hsdp2x4', 'ddp2', 'fsdp8·tp2' ('single' for one device)."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            parts = [f"hsdp{self.dp_replicate}x{self.dp_shard}"]
        elif self.dp_shard > 1:
            parts = [f"fsdp{self.dp_shard}"]
        elif self.dp_replicate > 1:
            parts = [f"ddp{self.dp_replicate}"]
        else:
            parts = []
        parts += [f"{name}{getattr(self, name)}" for name in ("tp", "pp", "cp") if getattr(self, name) > 1]
        return "·".join(parts) or "single"

"""Resolved parallel degrees and the device mesh built from them.

The launching process uses the degrees only; torch is imported where a mesh is built, so that
checking a config and placing a job stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan_exp.parallel.config import ParallelismConfig

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

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
        """Build from degrees that have already been resolved (no -1 left; see config.check)."""
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
        return self.dp_shard > 1

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

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The world mesh (None on a single device). Needs an initialized process group."""
        from torch.distributed.device_mesh import init_device_mesh

        from torch.distributed.device_mesh import init_device_mesh

        shape = self.mesh_shape()
        if not shape:
            return None
        mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
        if self.dp_replicate > 1 and self.dp_shard > 1:
            mesh[("dp_replicate", "dp_shard")]._flatten("dp")
        return mesh

    def dp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The data-parallel submesh: 1D for DDP or FSDP, 2D (replicate, shard) for HSDP."""
        names = tuple(n for n in ("dp_replicate", "dp_shard") if getattr(self, n) > 1)
        if mesh is None or not names:
            return None
        return mesh[names] if len(names) > 1 else mesh[names[0]]

    def dp_group(self, mesh: DeviceMesh | None) -> torch.distributed.ProcessGroup | None:
        """One process group over all data-parallel ranks, for averaging the loss."""
        if mesh is None or self.dp == 1:
            return None
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return mesh["dp"].get_group()
        return self.dp_mesh(mesh).get_group()

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        """This rank's index among the data-parallel ranks: which slice of the global batch it reads."""
        import torch.distributed as dist

        group = self.dp_group(mesh)
        return 0 if group is None else dist.get_rank(group)

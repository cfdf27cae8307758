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

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The world mesh (None on a single device), with the flattened groups below registered on it.
        Needs an initialized process group."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = self.mesh_shape()
        if not shape:
            return None
        mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
        for dims in _FLATTENED.values():
            present = self._present(dims)
            if len(present) > 1:
                mesh[present]._flatten(_FLATTENED_NAME[dims])
        return mesh

    def _present(self, dims: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(d for d in dims if getattr(self, d) > 1)

    def _submesh(self, mesh: DeviceMesh | None, dims: tuple[str, ...]) -> DeviceMesh | None:
        """The (flattened) submesh over those of `dims` that exist; None if none does."""
        present = self._present(dims)
        if mesh is None or not present:
            return None
        return mesh[present[0]] if len(present) == 1 else mesh[_FLATTENED_NAME[dims]]

    def dp_mesh(self, mesh: DeviceMesh | None) -> DeviceMesh | None:
        """The mesh FSDP/DDP spread over: 1D, or 2D (replicate, shard) for HSDP. Context-parallel ranks
        hold the same weights, so FSDP shards over data-shard × cp."""
        shard = self._submesh(mesh, _FLATTENED["shard"])
        replicate = self._submesh(mesh, ("dp_replicate",))
        if shard is not None and replicate is not None:
            return mesh[("dp_replicate", shard.mesh_dim_names[0])]
        return shard if shard is not None else replicate

    def dp_group(self, mesh: DeviceMesh | None) -> torch.distributed.ProcessGroup | None:
        """The ranks that read different batches (context-parallel ranks share one)."""
        submesh = self._submesh(mesh, _FLATTENED["data"])
        return None if submesh is None else submesh.get_group()

    def loss_group(self, mesh: DeviceMesh | None) -> torch.distributed.ProcessGroup | None:
        """The ranks whose losses are averaged: every batch, and every sequence slice of it."""
        submesh = self._submesh(mesh, _FLATTENED["loss"])
        return None if submesh is None else submesh.get_group()

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        """This rank's index among the data-parallel ranks: which slice of the global batch it reads."""
        import torch.distributed as dist

        group = self.dp_group(mesh)
        return 0 if group is None else dist.get_rank(group)


# Groups spanning several mesh dims, flattened once when the mesh is built.
_FLATTENED = {
    "data": ("dp_replicate", "dp_shard"),
    "shard": ("dp_shard", "cp"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
}
_FLATTENED_NAME = {dims: "_".join(dims) for dims in _FLATTENED.values()}

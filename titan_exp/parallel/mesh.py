"""The device mesh of a layout and the process groups the trainer needs from it.

Mesh dims are torchtitan's, outermost first: pp, dp_replicate, dp_shard, cp, tp (only those of size
> 1). Groups that span several dims (the data-parallel ranks, FSDP's shard ranks, the ranks whose
losses are averaged) are flattened once, when the mesh is built. Needs an initialized process group.
"""

import socket
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_exp.parallel.dims import ParallelDims

# Groups spanning several mesh dims, by what they are for.
_FLATTENED = {
    # The ranks that read different batches (context-parallel ranks share one).
    "data": ("dp_replicate", "dp_shard"),
    # The ranks FSDP shards over: context-parallel ranks hold the same weights.
    "shard": ("dp_shard", "cp"),
    # The ranks whose losses are averaged: every batch, and every sequence slice of it.
    "loss": ("dp_replicate", "dp_shard", "cp"),
}
_FLATTENED_NAME = {dims: "_".join(dims) for dims in _FLATTENED.values()}


class ParallelMesh:
    """The world mesh of `dims` (none on a single device) and its submeshes and groups."""

    def __init__(self, dims: ParallelDims, device_type: str):
        self.dims = dims
        # The flattened meshes, by name, kept here: slicing one back out of the root mesh is
        # deprecated (torch warns; "users need to bookkeep the flattened mesh directly").
        self.flattened: dict[str, DeviceMesh] = {}
        self.mesh = self._build(device_type)
        # Each rank's host, by global rank (None on the fake process group, whose ranks are not
        # processes): one gather at start-up, so that rank 0 can say where each mesh dim runs.
        self.hosts = _gather_hosts()

    def _build(self, device_type: str) -> DeviceMesh | None:
        shape = self.dims.mesh_shape()
        if not shape:
            return None
        mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
        for dims in _FLATTENED.values():
            present = self._present(dims)
            if len(present) > 1:
                self.flattened[_FLATTENED_NAME[dims]] = mesh[present]._flatten(_FLATTENED_NAME[dims])
        return mesh

    def __getitem__(self, dim: str) -> DeviceMesh:
        """The 1D submesh of one dim (which must be > 1), e.g. mesh["tp"]."""
        return self.mesh[dim]

    def _present(self, dims: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(d for d in dims if getattr(self.dims, d) > 1)

    def _submesh(self, dims: tuple[str, ...]) -> DeviceMesh | None:
        """The (flattened) submesh over those of `dims` that exist; None if none does."""
        present = self._present(dims)
        if self.mesh is None or not present:
            return None
        return self.mesh[present[0]] if len(present) == 1 else self.flattened[_FLATTENED_NAME[dims]]

    def _group(self, dims: tuple[str, ...]) -> dist.ProcessGroup | None:
        submesh = self._submesh(dims)
        return None if submesh is None else submesh.get_group()

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP/DDP spread over: 1D, or 2D (replicate, shard) for HSDP; FSDP shards over
        data-shard × cp."""
        shard = self._submesh(_FLATTENED["shard"])
        replicate = self._submesh(("dp_replicate",))
        if shard is not None and replicate is not None:
            return DeviceMesh._concatenate([replicate, shard])  # as FSDP2 builds its HSDP mesh (_fsdp_init.py)
        return shard if shard is not None else replicate

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self._group(_FLATTENED["data"])

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        return self._group(_FLATTENED["loss"])

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self._group(("pp",))

    @property
    def pp_rank(self) -> int:
        """This rank's index along the pipeline (0 without one)."""
        return self.mesh["pp"].get_local_rank() if self.dims.pp > 1 else 0

    def host_grid(self) -> dict[str, object] | None:
        """The mesh's dims and, at each position of it, the host of the rank there (nested lists,
        outermost dim first). None without a mesh or without hosts."""
        if self.mesh is None or self.hosts is None:
            return None
        hosts = _map_nested(self.mesh.mesh.tolist(), lambda rank: self.hosts[rank])
        return {"dims": list(self.mesh.mesh_dim_names), "hosts": hosts}

    def dims_across_hosts(self) -> dict[str, bool]:
        """For each mesh dim, whether any of its groups spans more than one host (HSDP's replicas
        should sit on different hosts, its shards on one)."""
        if self.mesh is None or self.hosts is None:
            return {}
        names = sorted(set(self.hosts))
        where = self.mesh.mesh.clone().apply_(lambda rank: names.index(self.hosts[rank]))  # a host index per rank
        dims = enumerate(self.mesh.mesh_dim_names)
        return {name: bool((where.amax(dim=d) != where.amin(dim=d)).any()) for d, name in dims}

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: which slice of the global batch it reads."""
        group = self.dp_group
        return 0 if group is None else dist.get_rank(group)


def _gather_hosts() -> list[str] | None:
    if not dist.is_initialized():
        return [socket.gethostname()]
    if dist.get_backend() == "fake":
        return None
    hosts: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def _map_nested(items: list, fn: Callable[[int], str]) -> list:
    return [_map_nested(item, fn) if isinstance(item, list) else fn(item) for item in items]


def set_collective_timeout(seconds: int) -> None:
    """Every process group's collectives wait `seconds` for the other ranks from now on (torchtitan
    shortens the timeout once the first step is done: compiling and building are behind)."""
    if not dist.is_initialized():
        return
    dist.barrier()  # no rank changes it while another is still in a collective of the first step
    for group in list(dist.distributed_c10d._world.pg_map):  # the mesh's groups, flattened ones included
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)

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

# Groups spanning several mesh dims, by what they are for, and the name of their flattened mesh.
# Under expert parallelism dp_shard is two mesh dims (parallel/dims.py), dp_shard_mod_ep and
# dp_shard_in_ep, and stands for both here.
_FLATTENED = {
    # The ranks that read different batches (context-parallel ranks share one).
    "data": ("dp_replicate", "dp_shard"),
    # The ranks FSDP shards over: context-parallel ranks hold the same weights.
    "shard": ("dp_shard", "cp"),
    # The ranks whose losses are averaged: every batch, and every sequence slice of it.
    "loss": ("dp_replicate", "dp_shard", "cp"),
    # The ranks a MoE layer's experts are split over (torchtitan's "ep"): without tp where TP
    # splits the experts themselves (ParallelDims.ep_spans).
    "ep": ("dp_shard_in_ep", "cp", "tp"),
    # The ranks whose tokens pass the same layers at once (all but the pipeline's): flattened
    # when first asked for, by every rank at once (a MoE model's auxiliary loss).
    "tokens": ("dp_replicate", "dp_shard", "cp", "tp"),
}
_ON_DEMAND = ("tokens",)
_FLATTENED_NAME = {
    "data": "dp_replicate_dp_shard",
    "shard": "dp_shard_cp",
    "loss": "dp_replicate_dp_shard_cp",
    "ep": "ep",
    "tokens": "tokens",
}


class ParallelMesh:
    """The world mesh of `dims` (none on a single device) and its submeshes and groups."""

    def __init__(self, dims: ParallelDims, device_type: str):
        self.dims = dims
        # The flattened meshes, by purpose, kept here: slicing one back out of the root mesh is
        # deprecated (torch warns; "users need to bookkeep the flattened mesh directly").
        self.flattened: dict[str, DeviceMesh] = {}
        self.mesh = self._build(device_type)
        # Each rank's host, by global rank (None on the fake process group, whose ranks are not
        # processes): one gather at start-up, so that rank 0 can say where each mesh dim runs.
        self.hosts = _gather_hosts()

    def _build(self, device_type: str) -> DeviceMesh | None:
        shape = self.dims.device_mesh_shape()
        if not shape:
            return None
        mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
        for purpose in [p for p in _FLATTENED if p not in _ON_DEMAND]:  # one order on every rank
            present = self._present(purpose)
            if len(present) > 1:
                self.flattened[purpose] = mesh[present]._flatten(_FLATTENED_NAME[purpose])
        return mesh

    def __getitem__(self, dim: str) -> DeviceMesh:
        """The 1D submesh of one dim (which must be > 1), e.g. mesh["tp"]."""
        return self.mesh[dim]

    def _present(self, purpose: str) -> tuple[str, ...]:
        """The mesh dims of size > 1 that the group for `purpose` spans."""
        shape = self.dims.device_mesh_shape()
        split = self.dims.ep > 1  # dp_shard is two mesh dims
        spans = _FLATTENED[purpose]
        if purpose == "ep":
            spans = tuple(dim for dim in spans if dim == "dp_shard_in_ep" or dim in self.dims.ep_spans)
        expanded = [
            part
            for dim in spans
            for part in (("dp_shard_mod_ep", "dp_shard_in_ep") if dim == "dp_shard" and split else (dim,))
        ]
        return tuple(d for d in expanded if shape.get(d, 1) > 1)

    def _submesh(self, purpose: str) -> DeviceMesh | None:
        """The (flattened) submesh of the group for `purpose`; None where it is one rank."""
        present = self._present(purpose)
        if self.mesh is None or not present:
            return None
        if len(present) == 1:
            return self.mesh[present[0]]
        if purpose not in self.flattened:
            self.flattened[purpose] = self.mesh[present]._flatten(_FLATTENED_NAME[purpose])
        return self.flattened[purpose]

    def _group(self, purpose: str) -> dist.ProcessGroup | None:
        submesh = self._submesh(purpose)
        return None if submesh is None else submesh.get_group()

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The mesh tensor parallelism splits the model over (None without it)."""
        return self.mesh["tp"] if self.dims.tp > 1 else None

    @property
    def experts_split_by_tp(self) -> bool:
        """Whether TP splits each expert's hidden dim (ParallelDims.experts_tp)."""
        return self.dims.experts_tp > 1

    @property
    def token_group(self) -> dist.ProcessGroup | None:
        """The ranks that run the same layers on different tokens (every rank but the pipeline's)."""
        return self._group("tokens")

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The ranks each MoE layer's experts are split over (None without expert parallelism)."""
        return self._submesh("ep") if self.dims.ep > 1 else None

    @property
    def experts_mesh(self) -> DeviceMesh | None:
        """The mesh the experts' weights are DTensors on: EP's ranks (split by expert), TP's (split
        by hidden dim, where TP splits them), or both (EP's outer); None where neither splits them."""
        parts = []
        if self.dims.ep > 1:
            parts.append(self.ep_mesh)
        if self.experts_split_by_tp:
            parts.append(self.tp_mesh)
        if len(parts) == 2:  # as FSDP2 builds its HSDP mesh
            return DeviceMesh._concatenate(parts)
        return parts[0] if parts else None

    @property
    def expert_shard_mesh(self) -> DeviceMesh | None:
        """Under expert parallelism, the ranks each expert is FSDP-sharded over: the data-parallel
        ranks EP leaves (a mesh of one rank where it leaves none), with the replicas' dim under HSDP."""
        if self.dims.ep == 1:
            return None
        shard = self.mesh["dp_shard_mod_ep"]
        if self.dims.dp_replicate > 1:  # HSDP of the experts, as of the dense weights
            return DeviceMesh._concatenate([self.mesh["dp_replicate"], shard])
        return shard

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP/DDP spread over: 1D, or 2D (replicate, shard) for HSDP; FSDP shards over
        data-shard × cp."""
        shard = self._submesh("shard")
        replicate = self.mesh["dp_replicate"] if self.dims.dp_replicate > 1 else None
        if shard is not None and replicate is not None:
            return DeviceMesh._concatenate([replicate, shard])  # as FSDP2 builds its HSDP mesh (_fsdp_init.py)
        return shard if shard is not None else replicate

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self._group("data")

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        return self._group("loss")

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["pp"].get_group() if self.dims.pp > 1 else None

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

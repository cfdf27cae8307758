"""Parallel degrees on their own: the names a layout gets, and the mesh and groups built from it
(on the fake process group, as rank 0 of a larger world)."""

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_exp.parallel.config import ParallelismConfig
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.mesh import ParallelMesh


def dims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1) -> ParallelDims:
    return ParallelDims(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp)


@pytest.mark.parametrize(
    "layout,label,describe,non_data_parallel",
    [
        (dims(), "single", "single", 1),
        (dims(dp_replicate=4), "ddp4", "dp_replicate4", 1),
        (dims(dp_shard=8), "fsdp8", "dp_shard8", 1),
        (dims(dp_replicate=2, dp_shard=4), "hsdp2x4", "dp_replicate2·dp_shard4", 1),
        (dims(dp_shard=8, tp=2), "fsdp8·tp2", "dp_shard8·tp2", 2),
        (dims(pp=8, dp_shard=8, tp=8), "fsdp8·tp8·pp8", "pp8·dp_shard8·tp8", 64),
        (dims(dp_shard=2, cp=4), "fsdp2·cp4", "dp_shard2·cp4", 4),
    ],
)
def test_labels_and_sizes(layout, label, describe, non_data_parallel):
    assert layout.label() == label and layout.describe() == describe
    assert layout.non_data_parallel_size == non_data_parallel
    assert layout.world_size == layout.dp * non_data_parallel


def test_degrees_come_from_the_config_keys_in_mesh_order():
    cfg = ParallelismConfig(data_parallel_shard_degree=4, tensor_parallel_degree=2, pipeline_parallel_degree=2)
    assert ParallelDims.resolve(cfg, 16) == dims(pp=2, dp_shard=4, tp=2)
    assert list(ParallelDims.resolve(cfg, 16).mesh_shape()) == ["pp", "dp_shard", "tp"]
    assert ParallelDims.resolve(ParallelismConfig(tensor_parallel_degree=2), 8) == dims(dp_shard=4, tp=2)  # -1 fills


def test_dims_refuse_unresolved_degrees():
    with pytest.raises(ValueError, match="degrees are >= 1"):
        dims(dp_shard=-1)


@pytest.fixture
def fake_world():
    """This process as rank 0 of a world of `size` on the fake process group."""

    def join(size: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "layout,dp_mesh_dims,dp_size,loss_size",
    [
        (dims(dp_shard=4), ("dp_shard",), 4, 4),
        (dims(dp_replicate=2, dp_shard=2, tp=2), ("dp_replicate", "dp_shard"), 4, 4),
        # FSDP shards over data-shard × cp; the losses are averaged over both, batches differ over dp only.
        (dims(dp_shard=2, cp=2, tp=2), ("dp_shard_cp",), 2, 4),
        (dims(dp_replicate=2, dp_shard=2, cp=2), ("dp_replicate", "dp_shard_cp"), 4, 8),
        (dims(pp=2, dp_shard=2, tp=2), ("dp_shard",), 2, 2),
        (dims(tp=4), None, 1, 1),
    ],
)
@pytest.mark.filterwarnings("error")  # no deprecated DeviceMesh use (a flattened dim sliced from the root mesh)
def test_mesh_and_groups(fake_world, layout, dp_mesh_dims, dp_size, loss_size):
    fake_world(layout.world_size)
    mesh = ParallelMesh(layout, "cpu")
    assert mesh.mesh.mesh_dim_names == tuple(layout.mesh_shape())
    assert tuple(mesh.mesh.shape) == tuple(layout.mesh_shape().values())
    assert (mesh.dp_mesh.mesh_dim_names if mesh.dp_mesh is not None else None) == dp_mesh_dims
    group_size = lambda group: 1 if group is None else dist.get_world_size(group)  # noqa: E731
    assert group_size(mesh.dp_group) == dp_size and group_size(mesh.loss_group) == loss_size
    assert group_size(mesh.pp_group) == layout.pp
    assert mesh.dp_rank == 0 and mesh.pp_rank == 0


def test_single_device_has_no_mesh():
    mesh = ParallelMesh(dims(), "cpu")  # no process group needed
    assert mesh.mesh is None and mesh.dp_mesh is None and mesh.dp_group is None and mesh.dp_rank == 0

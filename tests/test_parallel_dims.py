"""Parallel degrees on their own: the names a layout gets, and the mesh and groups built from it
(on the fake process group, as rank 0 of a larger world)."""

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_exp.parallel.config import ParallelismConfig
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.rules import ConfigError


def dims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1, etp=1) -> ParallelDims:
    return ParallelDims(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, etp=etp)


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
        # Expert parallelism borrows ranks: no change to the world or to what a device's tokens are.
        (dims(dp_shard=8, ep=4), "fsdp8·ep4", "dp_shard8·ep4", 1),
        (dims(pp=2, dp_shard=2, tp=2, ep=2), "fsdp2·tp2·pp2·ep2", "pp2·dp_shard2·tp2·ep2", 4),
        # TP splitting the experts is named beside EP; without EP it is the layout's TP.
        (dims(dp_shard=4, tp=2, ep=4, etp=2), "fsdp4·tp2·ep4·etp2", "dp_shard4·tp2·ep4·etp2", 2),
        (dims(dp_shard=4, tp=2), "fsdp4·tp2", "dp_shard4·tp2", 2),
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


@pytest.mark.parametrize(
    "layout,in_ep,mod_ep,mesh",
    [
        # EP takes its ranks from dp_shard; the experts are FSDP-sharded over what it leaves.
        (dims(dp_shard=8, ep=2), 2, 4, {"dp_shard_mod_ep": 4, "dp_shard_in_ep": 2}),
        (dims(dp_shard=2, ep=2), 2, 1, {"dp_shard_mod_ep": 1, "dp_shard_in_ep": 2}),
        # ... after all of cp and tp.
        (dims(dp_shard=4, cp=2, ep=4), 2, 2, {"dp_shard_mod_ep": 2, "dp_shard_in_ep": 2, "cp": 2}),
        (dims(dp_shard=2, tp=2, ep=2), 1, 2, {"dp_shard_mod_ep": 2, "tp": 2}),
        # ... but not tp where TP splits the experts themselves.
        (dims(dp_shard=2, tp=2, ep=2, etp=2), 2, 1, {"dp_shard_mod_ep": 1, "dp_shard_in_ep": 2, "tp": 2}),
        (dims(pp=2, dp_shard=4), 1, 4, {"pp": 2, "dp_shard": 4}),
    ],
)
def test_expert_parallel_splits_the_data_shard_dim(layout, in_ep, mod_ep, mesh):
    assert (layout.dp_shard_in_ep, layout.dp_shard_mod_ep) == (in_ep, mod_ep)
    assert layout.device_mesh_shape() == mesh


@pytest.mark.parametrize(
    "degrees,world,fix",
    [
        (dict(expert_parallel_degree=3, data_parallel_shard_degree=4), 4, r"must divide .*\(4×1×1\)"),
        (dict(expert_parallel_degree=2, tensor_parallel_degree=4), 8, r"multiple of context × tensor parallel \(1×4\)"),
        (dict(expert_parallel_degree=8), 4, r"must divide"),
    ],
)
def test_expert_parallel_degree_must_fit_the_ranks_it_borrows(degrees, world, fix):
    with pytest.raises(ConfigError, match=fix) as error:
        ParallelDims.resolve(ParallelismConfig(**degrees), world)
    assert error.value.key == "parallelism.expert_parallel_degree"


@pytest.mark.parametrize(
    "degrees,world,etp",
    [
        (dict(tensor_parallel_degree=2), 4, 2),  # no EP: the experts split as the dense weights
        (dict(tensor_parallel_degree=2, expert_parallel_degree=2), 4, 1),
        (dict(tensor_parallel_degree=-1, expert_parallel_degree=2, expert_tensor_parallel_degree=2), 4, 2),
    ],
)
def test_the_experts_are_split_by_tp_without_ep_or_with_etp(degrees, world, etp):
    assert ParallelDims.resolve(ParallelismConfig(data_parallel_shard_degree=2, **degrees), world).experts_tp == etp


def test_the_experts_tensor_parallel_degree_is_1_or_tp():
    with pytest.raises(ConfigError, match=r"must be 1 \(experts whole\) or the tensor-parallel degree 4") as error:
        ParallelDims.resolve(ParallelismConfig(tensor_parallel_degree=4, expert_tensor_parallel_degree=2), 8)
    assert error.value.key == "parallelism.expert_tensor_parallel_degree"


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
        (dims(dp_shard=4, ep=2), ("dp_shard_cp",), 4, 4),
        (dims(dp_shard=2, tp=2, ep=2), ("dp_shard_mod_ep",), 2, 2),
        (dims(dp_replicate=2, dp_shard=2, ep=2), ("dp_replicate", "dp_shard_in_ep"), 4, 4),
        (dims(dp_shard=4, tp=2, ep=2, etp=2), ("dp_shard_cp",), 4, 4),
    ],
)
@pytest.mark.filterwarnings("error")  # no deprecated DeviceMesh use (a flattened dim sliced from the root mesh)
def test_mesh_and_groups(fake_world, layout, dp_mesh_dims, dp_size, loss_size):
    fake_world(layout.world_size)
    mesh = ParallelMesh(layout, "cpu")
    assert mesh.mesh.mesh_dim_names == tuple(layout.device_mesh_shape())
    assert tuple(mesh.mesh.shape) == tuple(layout.device_mesh_shape().values())
    assert (mesh.dp_mesh.mesh_dim_names if mesh.dp_mesh is not None else None) == dp_mesh_dims
    group_size = lambda group: 1 if group is None else dist.get_world_size(group)  # noqa: E731
    assert group_size(mesh.dp_group) == dp_size and group_size(mesh.loss_group) == loss_size
    assert group_size(mesh.pp_group) == layout.pp
    assert mesh.dp_rank == 0 and mesh.pp_rank == 0
    if layout.ep > 1:
        experts = mesh.expert_shard_mesh  # HSDP's replicas, then the shards EP leaves
        assert mesh.ep_mesh.size() == layout.ep and experts.size() == layout.dp_replicate * layout.dp_shard_mod_ep
        # The experts' weights: split by expert over EP's ranks, by hidden dim over TP's where it splits them.
        assert mesh.experts_mesh.size() == layout.ep * layout.experts_tp
        assert mesh.experts_mesh.ndim == (2 if layout.experts_tp > 1 else 1)
    else:
        assert mesh.ep_mesh is None and mesh.expert_shard_mesh is None


def test_single_device_has_no_mesh():
    mesh = ParallelMesh(dims(), "cpu")  # no process group needed
    assert mesh.mesh is None and mesh.dp_mesh is None and mesh.dp_group is None and mesh.dp_rank == 0

"""The experts of a mixture-of-experts model placed on the mesh before tensor parallelism and FSDP:
split by expert over the EP ranks, each one's hidden dim over the tp ranks where TP splits the
experts; and the process groups the MoE layers exchange tokens and count routing over. Reads the MoE
layers by their parts (models/common/moe/layer.py: `moe.experts` with stacked w1, w2, w3)."""

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

from titan_exp.dependency_warnings import ignore_sequential_redistribute_log
from titan_exp.parallel.mesh import ParallelMesh


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The model's (or pipeline stage's) MoE feed-forwards."""
    return [block.moe for block in model.layers.values() if block.moe is not None]


def place_experts(model: nn.Module, mesh: ParallelMesh, aux_loss: bool) -> None:
    """Each MoE layer's experts as DTensors (so that checkpoints and initialization see the whole
    stack): split by expert over the EP ranks, each one's hidden dim over the tp ranks where TP
    splits the experts (w1 and w3 are (experts, hidden, dim), w2 (experts, dim, hidden)); tokens
    reach the EP ranks by all-to-all. `aux_loss`: the layers count the routed tokens over the
    ranks that share the global batch (asked for on every rank, whether or not its stage holds a
    MoE layer: a new group is collective)."""
    if aux_loss:
        token_group = mesh.token_group
        for moe in moe_layers(model):
            moe.token_group = token_group
    dims, experts_mesh = mesh.dims, mesh.experts_mesh
    if experts_mesh is None:  # neither EP nor TP splits them
        return
    by_expert = [Shard(0)] if dims.ep > 1 else []
    # w2's bias is each expert's output's, whole on every tp rank (GroupedExperts.hidden_split).
    by_hidden = {"w1": Shard(1), "w2": Shard(2), "w3": Shard(1), "w1_bias": Shard(1), "w2_bias": Replicate(),
                 "w3_bias": Shard(1)}  # fmt: skip

    def split(name, module, device_mesh):
        for param_name, param in list(module.named_parameters(recurse=False)):
            placements = by_expert + ([by_hidden[param_name]] if mesh.experts_split_by_tp else [])
            sharded = nn.Parameter(distribute_tensor(param, device_mesh, placements, src_data_rank=None))
            module.register_parameter(param_name, sharded)

    for moe in moe_layers(model):
        distribute_module(moe.experts, experts_mesh, partition_fn=split)
        if mesh.experts_split_by_tp:
            moe.experts.hidden_split = dims.experts_tp
        if dims.ep > 1:
            moe.experts.ep_group = mesh.ep_mesh.get_group()
    ignore_sequential_redistribute_log()  # the gradient norm over FSDP's and EP's dims

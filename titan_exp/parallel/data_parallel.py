"""Data parallelism over a model of the shared decoder (models/common/transformer.py): FSDP2 (HSDP
on a 2D data-parallel mesh) with one unit per block, one for the embeddings and one for norm and
output (on GPUs), the experts of a MoE layer a unit of their own under expert parallelism; or DDP (FSDP2's
replicate, or DDP's reducer on gloo). On gloo, FSDP2's collectives become point-to-point sends that
overlap the compute."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import replicate as ddp
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from titan_exp.dependency_warnings import ignore_unavoidable_warnings
from titan_exp.parallel.gloo_comms import PeerAllGather, PeerReduceScatter
from titan_exp.parallel.mesh import ParallelMesh


@dataclass(frozen=True)
class GradientReduction:
    """How data-parallel gradients are reduced: FSDP's and DDP's dtypes (training.mixed_precision_*),
    and whether a reduction adds to gradients an earlier one left (each microbatch of an accumulating
    step reduces: training.gradient_sync=every_microbatch)."""

    param_dtype: str
    reduce_dtype: str
    adds_to_gradients: bool = False


def apply_ddp(model: nn.Module, mesh: ParallelMesh, mp_policy: MixedPrecisionPolicy, pipelined: bool) -> None:
    """Replicas over the data-parallel mesh: FSDP2's replicate, or where it cannot overlap its
    gradient all-reduce with backward (gloo: no side streams, so it all-reduces every gradient after
    backward) and nothing needs it (no DTensor weights, no mixed-precision cast, not a pipeline
    stage), DDP's own reducer, whose buckets are all-reduced while backward goes on (on 2 CPU ranks
    it trains 4% faster, as fast as plain DDP)."""
    dp_mesh = mesh.dp_mesh
    uncast = {mp_policy.param_dtype, mp_policy.reduce_dtype} <= {None, torch.float32}
    plain_weights = not any(isinstance(param, DTensor) for param in model.parameters())
    if dist.get_backend(dp_mesh.get_group()) == "gloo" and uncast and plain_weights and not pipelined:
        ddp(model, device_mesh=dp_mesh)
    else:
        replicate(model, mesh=dp_mesh, mp_policy=mp_policy)


def apply_fsdp(
    model: nn.Module,
    mesh: ParallelMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard: str,
    pipelined: bool,
    adds_to_gradients: bool = False,
) -> None:
    """`reshard`: parallelism.fsdp_reshard_after_forward (always, never, default); `pipelined`: the
    model is a pipeline stage; `adds_to_gradients`: a reduce-scatter's output is added to the
    sharded gradients an earlier microbatch left."""
    dp_mesh, last = mesh.dp_mesh, len(model.layers) - 1
    gloo = dist.get_backend(dp_mesh.get_group(dp_mesh.ndim - 1)) == "gloo"
    for index, block in enumerate(model.layers.values()):
        # The last block's params are needed right away by backward: keeping them saves an all-gather.
        # Under pipelining a stage's blocks run forward and backward for many microbatches
        # interleaved: kept gathered (torchtitan's default), not gathered again for each.
        reshard_after = {"always": True, "never": False}.get(reshard, index < last and not pipelined)
        if block.moe is not None and mesh.dims.ep > 1:
            _shard_experts(block.moe.experts, mesh, mp_policy, reshard_after)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after)
    # Units of their own for the embeddings and for norm + output, as torchtitan has them: the big
    # output matrix's reduce-scatter starts as soon as its backward ends, and the embeddings are not
    # gathered again for backward. Not on CPU ranks (gloo), where each unit is one more round of
    # hooks and exchanges on the cores that compute and memory is not short: the root keeps them, as
    # plain FSDP2 does (2 CPU ranks: 4-7% more tokens/s, benchmarks/bench_vs_plain.py). Nor a tied
    # weight, which must stay in one unit (the root) or it would be sharded twice. A pipeline stage
    # may hold neither the embeddings nor the output.
    if not model.cfg.tie_word_embeddings and not gloo:
        if model.tok_embeddings is not None:
            fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=mp_policy)
            # An embedding's backward needs only its output's gradient, not its weight: no all-gather.
            model.tok_embeddings.set_unshard_in_backward(False)
            ignore_unavoidable_warnings()  # under TP its output is a view, which FSDP warns of
        if model.output is not None:
            fully_shard([model.norm, model.output], mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)
    if gloo:
        _overlap_gloo_collectives(model, hsdp=dp_mesh.ndim == 2, mp_policy=mp_policy, adds=adds_to_gradients)


def _shard_experts(experts: nn.Module, mesh: ParallelMesh, mp_policy: MixedPrecisionPolicy, reshard_after: bool):
    """FSDP over the ranks EP leaves (its own unit: the block's mesh is another). Sharded by expert
    (dim 0) while each rank has an expert to keep, else along the hidden dim."""
    shard_mesh = mesh.expert_shard_mesh
    shards = shard_mesh.size(shard_mesh.ndim - 1)  # HSDP's shard dim is the last
    local_experts = experts.w1.to_local().shape[0]
    dim = 0 if local_experts % shards == 0 else 1
    fully_shard(
        experts,
        mesh=shard_mesh,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after,
        shard_placement_fn=lambda param: Shard(dim),
    )
    # Each expert's gradient already sums the EP ranks' tokens (the all-to-all's backward), and the
    # reduce-scatter adds the rest: divide by every rank whose loss is averaged, as dense FSDP does.
    dims = mesh.dims
    experts.set_gradient_divide_factor(dims.dp_replicate * dims.dp_shard * dims.cp)
    if shards > 1 and dist.get_backend(shard_mesh.get_group(shard_mesh.ndim - 1)) == "gloo":
        # A sum, then the division: gloo has no PREMUL_SUM. Not on one rank, where torch 2.13
        # divides twice when asked to sum (its copy in place of the reduce-scatter divides too).
        experts.set_force_sum_reduction_for_comms(True)


def _overlap_gloo_collectives(model: nn.Module, hsdp: bool, mp_policy: MixedPrecisionPolicy, adds: bool) -> None:
    """CPU ranks: FSDP2's collectives as point-to-point sends (parallel/gloo_comms.py), the next
    unit's all-gather posted before this unit computes (CUDA gets that overlap from streams), and
    the reduce-scatters finished one block later where FSDP2 only views their output."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    param_dtype = next(model.parameters()).dtype
    reduce_dtype = mp_policy.reduce_dtype or mp_policy.param_dtype or param_dtype  # FSDP2's rule
    # Deferred only where FSDP2 merely views the output (gloo_comms.PeerReduceScatter): not where it
    # adds it to an earlier microbatch's gradients at once.
    reduce_scatter = PeerReduceScatter(defer_in_backward=not hsdp and reduce_dtype == param_dtype and not adds)
    for unit in units:
        unit.set_custom_all_gather(PeerAllGather())
        unit.set_custom_reduce_scatter(reduce_scatter)  # one for all: it keeps one in flight
        unit._set_unshard_async_op(True)  # no public setter yet (torch 2.13)
    blocks = list(model.layers.values())  # the units in forward order: the root holds the rest
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])


def mixed_precision(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """FSDP's (and replicate's) parameter and gradient-reduction dtypes, by name."""
    return MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=getattr(torch, reduce_dtype))

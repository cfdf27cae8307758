"""Cut a Llama 3 model that still lives on the meta device into pipeline stages, and apply tensor/
sequence parallelism, activation checkpointing, compile and data parallelism (DDP / FSDP2 / HSDP). Order matters (as in
torchtitan): TP turns the weights into DTensors on the tp mesh, checkpointing wraps the blocks,
compile compiles the wrapped blocks, FSDP shards them over the data-parallel mesh last."""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_exp.dependency_warnings import ignore_sequential_redistribute_log, ignore_unavoidable_warnings
from titan_exp.models.llama3.model import Transformer
from titan_exp.models.moe.tensor_parallel import ExpertTensorParallel
from titan_exp.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_exp.parallel.config import ActivationCheckpointConfig, CompileConfig, ParallelismConfig
from titan_exp.parallel.gloo_comms import PeerAllGather, PeerReduceScatter
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.parallel.stages import StagePlan
from titan_exp.quantize.config import QuantizeConfig


def parallelize_llama(
    model: Transformer,
    mesh: ParallelMesh,
    parallelism: ParallelismConfig,
    ac: ActivationCheckpointConfig,
    compile_cfg: CompileConfig,
    quantize: QuantizeConfig,
    mp_policy: MixedPrecisionPolicy,
) -> Transformer:
    """`mp_policy`: FSDP's (and replicate's) parameter and gradient-reduction dtypes."""
    dims = mesh.dims
    if model.cfg.moe.aux_loss_coeff is not None:
        # Asked for on every rank, whether or not its stage holds a MoE layer: a new group is collective.
        token_group = mesh.token_group
        for block in model.layers.values():
            if block.moe is not None:
                block.moe.token_group = token_group
    if model.cfg.moe.enabled:
        distribute_experts(model, mesh)
    if dims.tp > 1:
        tp_mesh = mesh["tp"]
        # float8 tensorwise Linears take float8-aware TP styles, which cast before the collectives and
        # so move float8 over the wire: nccl can, gloo cannot ("Invalid scalar type"). On CPU the plain
        # styles gather in high precision and cast after, the same recipe with more traffic.
        float8_tp = quantize.name == "float8" and quantize.recipe == "tensorwise" and tp_mesh.device_type == "cuda"
        apply_tensor_parallel(model, tp_mesh, float8_tp, experts_split=dims.experts_tp > 1)
        if parallelism.enable_async_tensor_parallel:
            _enable_async_tensor_parallel(tp_mesh)
    apply_activation_checkpointing(model.layers, ac)
    if compile_cfg.compiles("model"):
        # Per block: the blocks are identical, so one compiled graph is reused for all of them.
        for block in model.layers.values():
            block.compile(backend=compile_cfg.backend, fullgraph=True)
    if dims.fsdp_enabled:
        _apply_fsdp(model, mesh, mp_policy, parallelism.fsdp_reshard_after_forward, pipelined=dims.pp > 1)
    elif dims.ddp_enabled:
        replicate(model, mesh=mesh.dp_mesh, mp_policy=mp_policy)
    return model


def _apply_fsdp(
    model: Transformer, mesh: ParallelMesh, mp_policy: MixedPrecisionPolicy, reshard: str, pipelined: bool
) -> None:
    """One FSDP unit per block, one for the embeddings, one for norm+output; HSDP when the dp mesh
    is 2D. Under expert parallelism each MoE layer's experts are a unit of their own, sharded over
    the data-parallel ranks EP leaves. On gloo the all-gathers and reduce-scatters are sends that
    need not be waited for (see below)."""
    dp_mesh, last = mesh.dp_mesh, len(model.layers) - 1
    for index, block in enumerate(model.layers.values()):
        # The last block's params are needed right away by backward: keeping them saves an all-gather.
        # Under pipelining a stage's blocks run forward and backward for many microbatches
        # interleaved: kept gathered (torchtitan's default), not gathered again for each.
        reshard_after = {"always": True, "never": False}.get(reshard, index < last and not pipelined)
        if block.moe is not None and mesh.dims.ep > 1:
            _shard_experts(block.moe.experts, mesh, mp_policy, reshard_after)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after)
    # A tied weight must stay in one unit (the root), or it would be sharded twice. A pipeline stage
    # may hold neither the embeddings nor the output.
    if not model.cfg.tie_word_embeddings:
        if model.tok_embeddings is not None:
            fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=mp_policy)
            # An embedding's backward needs only its output's gradient, not its weight: no all-gather.
            model.tok_embeddings.set_unshard_in_backward(False)
            ignore_unavoidable_warnings()  # under TP its output is a view, which FSDP warns of
        if model.output is not None:
            fully_shard([model.norm, model.output], mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)
    if dist.get_backend(dp_mesh.get_group(dp_mesh.ndim - 1)) == "gloo":
        _overlap_gloo_collectives(model, hsdp=dp_mesh.ndim == 2, mp_policy=mp_policy)


def _shard_experts(
    experts: torch.nn.Module, mesh: ParallelMesh, mp_policy: MixedPrecisionPolicy, reshard_after: bool
) -> None:
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


def _overlap_gloo_collectives(model: Transformer, hsdp: bool, mp_policy: MixedPrecisionPolicy) -> None:
    """CPU ranks: FSDP2's collectives as point-to-point sends (parallel/gloo_comms.py), the next
    unit's all-gather posted before this unit computes (CUDA gets that overlap from streams), and
    the reduce-scatters finished one block later where FSDP2 only views their output."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    param_dtype = next(model.parameters()).dtype
    reduce_dtype = mp_policy.reduce_dtype or mp_policy.param_dtype or param_dtype  # FSDP2's rule
    reduce_scatter = PeerReduceScatter(defer_in_backward=not hsdp and reduce_dtype == param_dtype)
    for unit in units:
        unit.set_custom_all_gather(PeerAllGather())
        unit.set_custom_reduce_scatter(reduce_scatter)  # one for all: it keeps one in flight
        unit._set_unshard_async_op(True)  # no public setter yet (torch 2.13)
    forward_order = [model.tok_embeddings, *model.layers.values(), model.norm]
    forward_order = [unit for unit in forward_order if isinstance(unit, FSDPModule)]
    for unit, following in zip(forward_order, forward_order[1:]):
        unit.set_modules_to_forward_prefetch([following])


def apply_tensor_parallel(
    model: Transformer, tp_mesh: DeviceMesh, float8: bool = False, experts_split: bool = False
) -> None:
    """Megatron-style TP with sequence parallelism, torchtitan's plan.

    Attention heads and the FFN hidden dimension are split column-wise in, row-wise out; between
    blocks the activations stay sharded along the sequence (norms run on their shard); the output
    projection keeps the vocabulary sharded, so the loss is computed without gathering the logits
    (the trainer wraps it in loss_parallel). `experts_split`: TP splits the experts too (their
    weights already are: distribute_experts), else expert parallelism spreads them over the tp ranks.
    """
    outer_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    # A pipeline stage holds only some of these.
    parallelize_module(
        model, tp_mesh, {name: plan for name, plan in outer_plan.items() if getattr(model, name) is not None}
    )
    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise, prepare_input = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    norms_plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    attention_plan = {
        "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1)),
    }
    dense_plan = {
        "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": colwise(),
    }
    for block in model.layers.values():
        ffn_plan = dense_plan if block.moe is None else _tensor_parallel_moe(block.moe, tp_mesh, experts_split)
        if model.cfg.mla.enabled:
            parallelize_module(
                block, tp_mesh, norms_plan | _tensor_parallel_latent_attention(block.attention, tp_mesh) | ffn_plan
            )
            continue
        parallelize_module(block, tp_mesh, norms_plan | attention_plan | ffn_plan)
        for norm in (block.attention.q_norm, block.attention.k_norm):
            if norm is not None:
                # Qwen3's q/k norms: (batch, seq, heads, head_dim), each rank its own heads.
                _replicated_on_local_tensors(norm, tp_mesh, Shard(2))


def distribute_experts(model: Transformer, mesh: ParallelMesh) -> None:
    """Each MoE layer's experts as DTensors (so that checkpoints and initialization see the whole
    stack): split by expert over the EP ranks, each one's hidden dim over the tp ranks where TP
    splits the experts (w1 and w3 are (experts, hidden, dim), w2 (experts, dim, hidden)); tokens
    reach the EP ranks by all-to-all. Nothing where neither splits them."""
    dims, experts_mesh = mesh.dims, mesh.experts_mesh
    if experts_mesh is None:
        return
    by_expert = [Shard(0)] if dims.ep > 1 else []
    by_hidden = {"w1": Shard(1), "w2": Shard(2), "w3": Shard(1)}

    def split(name, module, mesh):
        for param_name, param in list(module.named_parameters(recurse=False)):
            placements = by_expert + ([by_hidden[param_name]] if dims.experts_tp > 1 else [])
            sharded = nn.Parameter(distribute_tensor(param, mesh, placements, src_data_rank=None))
            module.register_parameter(param_name, sharded)

    for block in model.layers.values():
        if block.moe is not None:
            distribute_module(block.moe.experts, experts_mesh, partition_fn=split)
            if dims.ep > 1:
                block.moe.experts.ep_group = mesh.ep_mesh.get_group()
    ignore_sequential_redistribute_log()  # the gradient norm over FSDP's and EP's dims


def _tensor_parallel_latent_attention(attention: torch.nn.Module, tp_mesh: DeviceMesh) -> dict:
    """Latent attention under TP (torchtitan's split): the heads' up-projections (wq or wq_b, wkv_b)
    column-wise and wo row-wise, as a Llama block's; the down-projections to the latents and their
    norms whole on every rank, on the gathered sequence (their gradients arrive summed over the
    ranks' heads, through the column-wise inputs and the rotary key's sum)."""
    attention.tp_group = tp_mesh.get_group()
    whole = [attention.wkv_a, attention.kv_norm]
    if attention.mla.q_lora_rank:
        whole += [attention.wq_a, attention.q_norm]
    for module in whole:
        _replicated_on_local_tensors(module, tp_mesh, Replicate())
    queries = "attention.wq_b" if attention.mla.q_lora_rank else "attention.wq"
    return {
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
        ),
        queries: ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def _tensor_parallel_moe(moe: torch.nn.Module, tp_mesh: DeviceMesh, experts_split: bool) -> dict:
    """A MoE layer under TP. Each tp rank routes its own slice of the sequence (no all-gather), so
    the router is replicated and sees different tokens on each rank (its gradients are summed over
    the ranks). Where expert parallelism spreads the experts over the tp ranks, each rank runs its
    slice's tokens through them, and the shared experts are replicated as the router; where TP
    splits the experts (moe/tensor_parallel.py), the slices are gathered first and the shared
    experts split as a dense FFN, their outputs partial sums until the layer's reduce-scatter."""
    moe.token_slices = tp_mesh.size()
    _replicated_on_local_tensors(moe.router.gate, tp_mesh, Shard(0))  # (tokens, dim)
    plan = {
        "moe": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)
    }
    if not experts_split:
        if moe.shared is not None:
            _replicated_on_local_tensors(moe.shared, tp_mesh, Shard(0))
        return plan
    moe.expert_tp = ExpertTensorParallel(tp_mesh)
    if moe.shared is not None:  # input: the gathered tokens, a replicated DTensor
        plan |= {
            "moe.shared.w1": ColwiseParallel(),
            "moe.shared.w2": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
            "moe.shared.w3": ColwiseParallel(),
        }
    return plan


def _replicated_on_local_tensors(module: torch.nn.Module, tp_mesh: DeviceMesh, input_placement: Placement) -> None:
    """`module`'s weights replicated DTensors over the tp ranks (as every weight under TP: the
    optimizer takes one kind), its input and output local tensors. `input_placement` says how the
    ranks' inputs relate, and so whether DTensor sums the weights' gradients over the ranks:
    Replicate(), the same input on every rank (the gradients already agree); Shard(d), each rank's
    own slice along dim d (its own tokens, its own heads: each gradient is a partial sum)."""

    def local_in(module, inputs, mesh):
        return (DTensor.from_local(inputs[0], mesh, [input_placement], run_check=False),)

    def local_out(module, output, mesh):
        return output.to_local()

    distribute_module(module, tp_mesh, input_fn=local_in, output_fn=local_out)


def _enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """Overlap TP collectives with matmuls: an inductor pass over symmetric-memory groups (CUDA and
    compile only: config/check.py refuses it elsewhere)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def split_into_stages(model: Transformer, plan: StagePlan, stage_ids: list[int]) -> list[Transformer]:
    """Pipeline parallelism's cut: one copy of the (meta) model per stage, keeping only that stage's
    layers; layer names are kept, so initialization and checkpoints address parameters exactly as in
    the whole model."""
    parts = []
    for stage in stage_ids:
        part = copy.deepcopy(model)
        keep = {str(i) for i in plan.layers(stage, len(model.layers))}
        for name in list(part.layers):
            if name not in keep:
                del part.layers[name]
        if stage != 0:
            part.tok_embeddings = None
        if stage != plan.num_stages - 1:
            part.norm = None
            part.output = None
        parts.append(part)
    return parts

"""Cut a Llama 3 model that still lives on the meta device into pipeline stages, and apply tensor/
sequence parallelism, activation checkpointing, compile and data parallelism (DDP / FSDP2 / HSDP). Order matters (as in
torchtitan): TP turns the weights into DTensors on the tp mesh, checkpointing wraps the blocks,
compile compiles the wrapped blocks, FSDP shards them over the data-parallel mesh last."""

import copy

import torch
import torch.distributed as dist
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_exp.dependency_warnings import ignore_unavoidable_warnings
from titan_exp.models.llama3.model import Transformer
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
    if dims.tp > 1:
        tp_mesh = mesh["tp"]
        # float8 tensorwise Linears take float8-aware TP styles, which cast before the collectives and
        # so move float8 over the wire: nccl can, gloo cannot ("Invalid scalar type"). On CPU the plain
        # styles gather in high precision and cast after, the same recipe with more traffic.
        float8_tp = quantize.name == "float8" and quantize.recipe == "tensorwise" and tp_mesh.device_type == "cuda"
        apply_tensor_parallel(model, tp_mesh, float8_tp)
        if parallelism.enable_async_tensor_parallel:
            _enable_async_tensor_parallel(tp_mesh)
    apply_activation_checkpointing(model.layers, ac)
    if compile_cfg.compiles("model"):
        # Per block: the blocks are identical, so one compiled graph is reused for all of them.
        for block in model.layers.values():
            block.compile(backend=compile_cfg.backend, fullgraph=True)
    if dims.fsdp_enabled:
        _apply_fsdp(model, mesh.dp_mesh, mp_policy, parallelism.fsdp_reshard_after_forward, pipelined=dims.pp > 1)
    elif dims.ddp_enabled:
        replicate(model, mesh=mesh.dp_mesh, mp_policy=mp_policy)
    return model


def _apply_fsdp(
    model: Transformer, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, reshard: str, pipelined: bool
) -> None:
    """One FSDP unit per block, one for the embeddings, one for norm+output; HSDP when dp_mesh is 2D.
    On gloo the all-gathers and reduce-scatters are sends that need not be waited for (see below)."""
    last = len(model.layers) - 1
    for index, block in enumerate(model.layers.values()):
        # The last block's params are needed right away by backward: keeping them saves an all-gather.
        # Under pipelining a stage's blocks run forward and backward for many microbatches
        # interleaved: kept gathered (torchtitan's default), not gathered again for each.
        reshard_after = {"always": True, "never": False}.get(reshard, index < last and not pipelined)
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


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, float8: bool = False) -> None:
    """Megatron-style TP with sequence parallelism, torchtitan's plan.

    Attention heads and the FFN hidden dimension are split column-wise in, row-wise out; between
    blocks the activations stay sharded along the sequence (norms run on their shard); the output
    projection keeps the vocabulary sharded, so the loss is computed without gathering the logits
    (the trainer wraps it in loss_parallel).
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
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": colwise(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
        for norm in (block.attention.q_norm, block.attention.k_norm):
            if norm is not None:
                _replicate_head_norm(norm, tp_mesh)


def _replicate_head_norm(norm: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """A q/k norm (Qwen3's) under TP: its weight replicated over the tp ranks, its input each rank's
    heads (dim 2 of batch, seq, heads, head_dim). Declared so, the weight's gradient is a partial
    sum that DTensor reduces over the ranks, each of which saw only its own heads."""

    def heads_in(module, inputs, mesh):
        return (DTensor.from_local(inputs[0], mesh, [Shard(2)], run_check=False),)

    def local_out(module, output, mesh):
        return output.to_local()

    distribute_module(norm, tp_mesh, input_fn=heads_in, output_fn=local_out)


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

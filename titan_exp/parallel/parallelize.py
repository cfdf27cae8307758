"""The parallelization of one model part (the whole model, or a pipeline stage) that still lives on
the meta device, in torchtitan's order: the experts placed on their mesh, then TP turns the weights
into DTensors on the tp mesh, activation checkpointing wraps the blocks, compile compiles the
wrapped blocks, and FSDP shards them over the data-parallel mesh last (or DDP replicates them)."""

from torch import nn

from titan_exp.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_exp.parallel.config import ActivationCheckpointConfig, CompileConfig, ParallelismConfig
from titan_exp.parallel.data_parallel import GradientReduction, apply_ddp, apply_fsdp, mixed_precision
from titan_exp.parallel.expert_parallel import place_experts
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.parallel.tensor_parallel import apply_tensor_parallel, enable_async_tensor_parallel
from titan_exp.quantize.config import QuantizeConfig


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh,
    parallelism: ParallelismConfig,
    ac: ActivationCheckpointConfig,
    compile_cfg: CompileConfig,
    quantize: QuantizeConfig,
    reduction: GradientReduction,
) -> nn.Module:
    """`reduction`: how FSDP and DDP run (their dtypes; whether a reduction adds to an earlier one's)."""
    dims, tp_mesh = mesh.dims, mesh.tp_mesh
    if model.cfg.moe.enabled:
        place_experts(model, mesh, aux_loss=model.cfg.moe.aux_loss_coeff is not None)
    if tp_mesh is not None:
        # float8 tensorwise Linears take float8-aware TP styles, which cast before the collectives and
        # so move float8 over the wire: nccl can, gloo cannot ("Invalid scalar type"). On CPU the plain
        # styles gather in high precision and cast after, the same recipe with more traffic.
        float8_tp = quantize.name == "float8" and quantize.recipe == "tensorwise" and tp_mesh.device_type == "cuda"
        apply_tensor_parallel(model, tp_mesh, float8_tp, experts_split=mesh.experts_split_by_tp)
        if parallelism.enable_async_tensor_parallel:
            enable_async_tensor_parallel(tp_mesh)
    apply_activation_checkpointing(model.layers, ac)
    if compile_cfg.compiles("model"):
        # Per block: blocks alike share one compiled graph (GPT-OSS's windowed and full ones: two). A
        # MoE block breaks its graph where the routed counts go to the host (the experts' splits,
        # the load's bookkeeping), as torchtitan's MoE blocks do: compiled in parts.
        for block in model.layers.values():
            block.compile(backend=compile_cfg.backend, fullgraph=block.moe is None)
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            mesh,
            mixed_precision(reduction.param_dtype, reduction.reduce_dtype),
            parallelism.fsdp_reshard_after_forward,
            pipelined=dims.pp > 1,
            adds_to_gradients=reduction.adds_to_gradients,
        )
    elif dims.ddp_enabled:
        apply_ddp(model, mesh, mixed_precision(reduction.param_dtype, reduction.reduce_dtype), pipelined=dims.pp > 1)
    return model

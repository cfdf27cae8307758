"""Tensor and sequence parallelism over a model of the shared decoder (models/common/transformer.py),
torchtitan's plan: the embeddings row-wise onto sequence shards, the norms on their shards, the
output head column-wise with the vocabulary left sharded (the loss runs on the shards: loss_parallel);
inside each block the attention and the feed-forward split by plans of their own
(`tensor_parallel_plan`, beside each module: the heads, the SwiGLU's hidden columns, the experts)."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


@dataclass(frozen=True)
class TensorParallel:
    """What a module's `tensor_parallel_plan(tp)` is written with: the tp mesh, the styles (float8-aware
    ones where float8 Linears move float8 over the wire), and whether TP splits the experts too."""

    mesh: DeviceMesh
    colwise: type = ColwiseParallel
    rowwise: type = RowwiseParallel
    prepare_input: type = PrepareModuleInput
    experts_split: bool = False

    @classmethod
    def on(cls, mesh: DeviceMesh, float8: bool, experts_split: bool) -> "TensorParallel":
        if not float8:
            return cls(mesh, experts_split=experts_split)
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return cls(mesh, Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput, experts_split)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, float8: bool = False, experts_split: bool = False):
    """`float8`: float8-aware styles (they cast before the collectives); `experts_split`: TP splits
    the experts too (their weights already are: parallel/expert_parallel.py), else expert
    parallelism spreads them over the tp ranks."""
    outer_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    # A pipeline stage holds only some of these.
    parallelize_module(
        model, tp_mesh, {name: plan for name, plan in outer_plan.items() if getattr(model, name) is not None}
    )
    tp = TensorParallel.on(tp_mesh, float8, experts_split)
    for block in model.layers.values():
        ffn_name = "feed_forward" if block.moe is None else "moe"
        plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        for name in ("attention", ffn_name):
            own = getattr(block, name).tensor_parallel_plan(tp)
            plan |= {f"{name}.{key}" if key else name: style for key, style in own.items()}
        parallelize_module(block, tp_mesh, plan)


def replicated_on_local_tensors(module: nn.Module, tp_mesh: DeviceMesh, input_placement: Placement) -> None:
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


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """Overlap TP collectives with matmuls: an inductor pass over symmetric-memory groups (CUDA and
    compile only: config/check.py refuses it elsewhere)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)

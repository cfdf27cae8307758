"""Apply activation checkpointing, compile and data parallelism (DDP / FSDP2 / HSDP) to a Llama 3
model that still lives on the meta device. Order matters: checkpointing wraps the blocks, compile
compiles the wrapped blocks, FSDP shards them last."""

import torch
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan_exp.models.llama3.model import Transformer
from titan_exp.parallel.config import ParallelismConfig
from titan_exp.parallel.dims import ParallelDims
from titan_exp.train.activation_checkpoint import apply_activation_checkpointing
from titan_exp.train.config import ActivationCheckpointConfig, CompileConfig, TrainingConfig


def parallelize_llama(
    model: Transformer,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    parallelism: ParallelismConfig,
    training: TrainingConfig,
    ac: ActivationCheckpointConfig,
    compile_cfg: CompileConfig,
) -> Transformer:
    apply_activation_checkpointing(model.layers, ac)
    if compile_cfg.enable:
        # Per block: the blocks are identical, so one compiled graph is reused for all of them.
        for block in model.layers.values():
            block.compile(backend=compile_cfg.backend, fullgraph=True)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, training.mixed_precision_param),
        reduce_dtype=getattr(torch, training.mixed_precision_reduce),
    )
    if dims.fsdp_enabled:
        _apply_fsdp(model, dims.dp_mesh(mesh), mp_policy, parallelism.fsdp_reshard_after_forward)
    elif dims.ddp_enabled:
        replicate(model, mesh=dims.dp_mesh(mesh), mp_policy=mp_policy)
    return model


def _apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, reshard: str) -> None:
    """One FSDP unit per block, one for the embeddings, one for norm+output; HSDP when dp_mesh is 2D."""
    last = len(model.layers) - 1
    for index, block in enumerate(model.layers.values()):
        # The last block's params are needed right away by backward: keeping them saves an all-gather.
        reshard_after = {"always": True, "never": False}.get(reshard, index < last)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after)
    if not model.cfg.tie_word_embeddings:
        # A tied weight must stay in one unit (the root), or it would be sharded twice.
        fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=mp_policy)
        fully_shard([model.norm, model.output], mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)

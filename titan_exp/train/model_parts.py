"""The one model build, for training, the dry runs and the planner's measurement: the family's model
(models/registry.py) on the meta device → low-precision Linears (float8/mxfp8) → this rank's
pipeline stages → parallelized (parallel/parallelize.py: experts, TP, activation checkpointing,
compile, FSDP/DDP). The parts stay on meta: the caller materializes them (`materialize` for
training, fake tensors for a dry run)."""

from dataclasses import dataclass

import torch
from torch import nn

from titan_exp.checkpoint.hf import load_hf
from titan_exp.checkpoint.manager import load_model
from titan_exp.config.schema import JobConfig
from titan_exp.models.common.transformer import Transformer
from titan_exp.models.registry import build_model
from titan_exp.parallel.data_parallel import GradientReduction
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.parallel.parallelize import parallelize
from titan_exp.parallel.stages import StagePlan
from titan_exp.quantize.float8 import convert_linears


@dataclass
class ModelParts:
    """The model parts one rank holds: the whole model, or its pipeline stages."""

    parts: list[Transformer]
    # The pipeline stages of the parts ([0] without pipelining) and the plan they come from.
    stage_ids: list[int]
    stage_plan: StagePlan
    # Of the whole model, before it was split or sharded (for FLOPs per token).
    num_params: int
    num_embedding_params: int

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]


def build_model_parts(cfg: JobConfig, mesh: ParallelMesh, device: torch.device) -> ModelParts:
    """This rank's parts, parallelized for `mesh`, on meta. `device` is where they will live
    (float8 and mxfp8 depend on it)."""
    with torch.device("meta"):
        model = build_model(cfg.model)
    num_params, num_embedding_params = model.num_params(), model.tok_embeddings.weight.numel()
    convert_linears(model, cfg.quantize, device)
    stage_plan, stage_ids, parts = StagePlan(1, 1), [0], [model]
    if mesh.dims.pp > 1:
        stage_plan = StagePlan.from_config(cfg.parallelism, cfg.model.n_layers)
        stage_ids = stage_plan.stage_ids(mesh.pp_rank, mesh.dims.pp, cfg.parallelism.pipeline_parallel_schedule)
        parts = model.pipeline_stages(stage_plan, stage_ids)
    t = cfg.training
    # Each microbatch reducing its gradients, a reduction adds into the earlier ones' (not under a
    # pipeline, whose stages reduce after their last microbatch).
    accumulation = t.global_batch_size // (t.local_batch_size * mesh.dims.dp)
    adds = accumulation > 1 and t.gradient_sync == "every_microbatch" and mesh.dims.pp == 1
    reduction = GradientReduction(t.mixed_precision_param, t.mixed_precision_reduce, adds)
    for part in parts:
        parallelize(part, mesh, cfg.parallelism, cfg.activation_checkpoint, cfg.compile, cfg.quantize, reduction)
    return ModelParts(parts, stage_ids, stage_plan, num_params, num_embedding_params)


def materialize(model: ModelParts, cfg: JobConfig, device: torch.device) -> None:
    """Real tensors on `device`, initialized from the seed (layout-independent) or loaded."""
    for part in model.parts:
        part.to_empty(device=device)
        part.init_weights(cfg.debug.seed)
        if cfg.checkpoint.initial_load_in_hf:
            load_hf(part, cfg.checkpoint.initial_load_path, cfg.model)
        elif cfg.checkpoint.initial_load_path:
            load_model(part, cfg.checkpoint.initial_load_path)
        part.train()

"""The sections that decide how the model is spread over ranks and wrapped on each: `parallelism`
(key names are torchtitan's, so its flags paste as overrides), `activation_checkpoint`, `compile`.
Degrees are checked and resolved by ParallelDims (parallel/dims.py)."""

from dataclasses import dataclass, field
from typing import Optional

from titan_exp.rules import ConfigError, Section, check_choice, check_positive, label, one_of, torchtitan_name

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
# Rank r holds stages r and 2P-1-r, so the first and the last stage sit on the same rank.
V_SHAPED_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Several "virtual" stages per rank.
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", *V_SHAPED_SCHEDULES)
SCHEDULES = SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES
# The keys only pipelining reads.
PIPELINE_KEYS = (
    "pipeline_parallel_schedule",
    "pipeline_parallel_microbatch_size",
    "pipeline_parallel_layers_per_stage",
)
# Mesh dimension name for each degree key, outermost first (torchtitan's order).
MESH_DIMS = {
    "pipeline_parallel_degree": "pp",
    "data_parallel_replicate_degree": "dp_replicate",
    "data_parallel_shard_degree": "dp_shard",
    "context_parallel_degree": "cp",
    "tensor_parallel_degree": "tp",
}


@dataclass
class ParallelismConfig(Section):
    # Short name of the layout option, the MLflow tag `strategy`.
    name: str = label("fsdp", chosen_by="parallelism=<option> and the degrees")
    # Full replicas of the model (DDP; HSDP's replicate dimension when sharded too). Any degree may
    # be -1: whatever is left of the world size once the others are taken (at most one -1).
    data_parallel_replicate_degree: int = 1
    # Ranks that shard each parameter, gradient and optimizer state (FSDP2, ZeRO-3).
    data_parallel_shard_degree: int = -1
    # default: reshard after forward except for the last block, whose params backward needs at once,
    # and except under pipelining, where a stage's blocks stay gathered across its microbatches.
    fsdp_reshard_after_forward: str = one_of("default", "always", "never")
    # Tensor parallel with sequence parallel: each block's matmuls split over this many ranks.
    tensor_parallel_degree: int = 1
    # Overlap TP's collectives with its matmuls (CUDA, compile.enable).
    enable_async_tensor_parallel: bool = False
    # Pipeline stages: the layers split over this many ranks.
    pipeline_parallel_degree: int = 1
    # How microbatches flow through the stages (torch.distributed.pipelining's schedules).
    pipeline_parallel_schedule: str = one_of(*SCHEDULES, default="1F1B")
    # Samples per pipeline microbatch: local_batch_size / this = microbatches per step.
    pipeline_parallel_microbatch_size: int = 1
    # torchtitan's name today: pipeline microbatches per local batch.
    num_pp_microbatches: Optional[int] = torchtitan_name(of="parallelism.pipeline_parallel_microbatch_size")
    # Layers per stage; None: 1 stage per rank (2 for multi-stage schedules), layers split evenly.
    pipeline_parallel_layers_per_stage: Optional[int] = None
    # Context parallel: each sequence split over this many ranks (long contexts).
    context_parallel_degree: int = 1
    # Context-parallel attention: torch (torch's ring attention; CUDA only, no pipelining) |
    # allgather (K/V all-gathered over the cp ranks; any device, any backend) | auto (torch on CUDA).
    context_parallel_impl: str = one_of("auto", "torch", "allgather")
    # Expert parallelism (MoE models): each MoE layer's experts split over this many ranks, tokens
    # sent to their experts' ranks and back by all-to-all. Not a factor of the world size: EP
    # borrows its ranks from data_parallel_shard × context × tensor parallel (torchtitan's meaning);
    # the experts are FSDP-sharded over the data-parallel ranks it leaves.
    expert_parallel_degree: int = 1
    # Tensor parallel inside each expert (torchtitan's key, under expert parallelism): 1, each
    # expert whole on its rank, EP spanning the tp ranks; or tensor_parallel_degree, each expert's
    # hidden dim split over the tp ranks as a dense FFN's, EP borrowing from data × context
    # parallel only. Without EP the experts are split by TP whatever this says (torchtitan's rule).
    expert_tensor_parallel_degree: int = 1

    def check(self, key: str) -> None:
        super().check(key)
        check_positive(f"{key}.pipeline_parallel_microbatch_size", self.pipeline_parallel_microbatch_size)
        check_positive(f"{key}.expert_parallel_degree", self.expert_parallel_degree)
        check_positive(f"{key}.expert_tensor_parallel_degree", self.expert_tensor_parallel_degree)
        if self.pipeline_parallel_layers_per_stage is not None:
            check_positive(f"{key}.pipeline_parallel_layers_per_stage", self.pipeline_parallel_layers_per_stage)

    def degrees(self) -> dict[str, int]:
        """Every degree keyed by its config key, in mesh order (outermost first)."""
        return {key: getattr(self, key) for key in MESH_DIMS}


def resolved_context_parallel_impl(name: str, device: str) -> str:
    """`auto`: torch's ring attention where it exists (CUDA), the all-gather one elsewhere."""
    if name == "auto":
        return "torch" if device == "cuda" else "allgather"
    return name


@dataclass
class ActivationCheckpointConfig(Section):
    # Recompute activations in backward instead of keeping them: none | full | selective.
    mode: str = one_of("none", "full", "selective")
    # With mode=selective: "op" saves chosen op outputs in every block; an integer N checkpoints
    # every N-th block.
    selective_ac_option: str = "op"

    def check(self, key: str) -> None:
        super().check(key)
        option = self.selective_ac_option
        if self.mode == "selective" and option != "op" and (not option.isdigit() or int(option) < 1):
            raise ConfigError(
                f"{key}.selective_ac_option", option, "use 'op' or a positive integer N (every N-th block)"
            )


@dataclass
class CommConfig(Section):
    """How long a collective waits for the other ranks before it fails (torchtitan's keys): up to
    and through the first step (the rendezvous, model building, compilation), then in training."""

    init_timeout_seconds: int = 300
    train_timeout_seconds: int = 100
    # torchtitan's name today: default (real ranks) | fake_backend | local_tensor.
    mode: Optional[str] = torchtitan_name(of="debug.comm_mode")

    def check(self, key: str) -> None:
        for name in ("init_timeout_seconds", "train_timeout_seconds"):
            check_positive(f"{key}.{name}", getattr(self, name))


COMPILE_COMPONENTS = ("model", "loss")


@dataclass
class CompileConfig(Section):
    # torch.compile the model's blocks and the loss (compile.components).
    enable: bool = False
    # torch.compile's backend: inductor (generated kernels), or one of Dynamo's for debugging a
    # compile problem (eager: graph capture only; aot_eager: also AOTAutograd).
    backend: str = one_of("inductor", "aot_eager", "eager", "aot_eager_decomp_partition", "cudagraphs")
    # What compile.enable compiles (torchtitan's key): the transformer blocks, the loss.
    components: list[str] = field(default_factory=lambda: list(COMPILE_COMPONENTS))
    # torchtitan's place for it today.
    enable_async_tensor_parallel: Optional[bool] = torchtitan_name(of="parallelism.enable_async_tensor_parallel")

    def check(self, key: str) -> None:
        super().check(key)
        for component in self.components:
            check_choice(f"{key}.components", component, COMPILE_COMPONENTS)

    def compiles(self, component: str) -> bool:
        return self.enable and component in self.components

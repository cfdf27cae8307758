"""The sections that decide how the model is spread over ranks and wrapped on each: `parallelism`
(key names are torchtitan's, so its flags paste as overrides), `activation_checkpoint`, `compile`."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class ParallelismConfig:
    # Short name of the layout, used in run names and tables (the option file sets it).
    name: str = "fsdp"
    # -1: whatever is left of the world size once the other degrees are taken (at most one may be -1).
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    # default: reshard after forward except for the last block, whose params backward needs at once.
    fsdp_reshard_after_forward: str = "default"
    tensor_parallel_degree: int = 1
    enable_async_tensor_parallel: bool = False
    pipeline_parallel_degree: int = 1
    # GPipe | 1F1B (one stage per rank) | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble |
    # ZBVZeroBubble | DualPipeV (several "virtual" stages per rank)
    pipeline_parallel_schedule: str = "1F1B"
    # Samples per pipeline microbatch: local_batch_size / this = microbatches per step.
    pipeline_parallel_microbatch_size: int = 1
    # Layers per stage; None: 1 stage per rank (2 for multi-stage schedules), layers split evenly.
    pipeline_parallel_layers_per_stage: Optional[int] = None
    context_parallel_degree: int = 1
    # Context-parallel attention: torch (torch's ring attention; CUDA only, no pipelining) |
    # allgather (K/V all-gathered over the cp ranks; any device, any backend) | auto (torch on CUDA).
    context_parallel_impl: str = "auto"

    def degrees(self) -> dict[str, int]:
        """Every degree keyed by its config key, in mesh order (outermost first)."""
        return {
            "pipeline_parallel_degree": self.pipeline_parallel_degree,
            "data_parallel_replicate_degree": self.data_parallel_replicate_degree,
            "data_parallel_shard_degree": self.data_parallel_shard_degree,
            "context_parallel_degree": self.context_parallel_degree,
            "tensor_parallel_degree": self.tensor_parallel_degree,
        }


CONTEXT_PARALLEL_IMPLS = ("auto", "torch", "allgather")


def resolved_context_parallel_impl(name: str, device: str) -> str:
    """`auto`: torch's ring attention where it exists (CUDA), the all-gather one elsewhere."""
    if name == "auto":
        return "torch" if device == "cuda" else "allgather"
    return name


@dataclass
class ActivationCheckpointConfig:
    # none | full | selective
    mode: str = "none"
    # With mode=selective: "op" saves chosen op outputs in every block; an integer N checkpoints
    # every N-th block.
    selective_ac_option: str = "op"


@dataclass
class CompileConfig:
    enable: bool = False
    backend: str = "inductor"

"""An analytic estimate of what one rank holds at its peak, from the model's shape and the layout
alone (no torch, so the launching process can make it): parameters, gradients and optimizer state
as sharded by the layout, activations as kept by the schedule and activation checkpointing, the
float32 logits of the loss, and what a process holds before any tensor. The pre-flight check holds
it against the memory the ranks can have (job/preflight.py). The planner measures rank 0's
memory instead where it can (plan/measure.py); this estimate errs on the high side."""

import dataclasses
import math
from dataclasses import dataclass

from titan_exp.models.llama3.args import Llama3Config
from titan_exp.parallel.config import (
    SINGLE_STAGE_SCHEDULES,
    V_SHAPED_SCHEDULES,
    ActivationCheckpointConfig,
    ParallelismConfig,
)
from titan_exp.units import GIB

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# fp32 master weights (4), their gradients (4), AdamW's two moments (8).
_PARAM_BYTES, _GRAD_BYTES, _ADAM_BYTES = 4, 4, 8
# What a rank holds before any tensor on a CPU: the interpreter, torch, the process group.
CPU_RANK_BASELINE_BYTES = int(0.4 * GIB)
# On a CPU a process's resident memory runs above its live tensors: glibc keeps freed blocks.
_CPU_ALLOCATOR_SLACK = 1.1


@dataclass(frozen=True)
class RankMemory:
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    logits: int
    temporaries: int
    # FSDP's gathered layers (the running one and the prefetched next) and a layer's reduce-scatter buffer.
    communication: int
    process: int

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def describe(self) -> str:
        parts = {field.name.replace("_", " "): getattr(self, field.name) for field in dataclasses.fields(self)}
        return " + ".join(f"{name} {size / GIB:.1f}" for name, size in parts.items() if size) + " GiB"


def layer_parameters(m: Llama3Config) -> int:
    attention = m.dim * m.n_heads * m.head_dim * 2 + 2 * m.dim * m.kv_heads * m.head_dim
    return attention + 3 * m.dim * m.ffn_hidden_dim + 2 * m.dim


def saved_per_token(m: Llama3Config) -> int:
    """Elements one token leaves per transformer layer for its backward, counted on this model:
    both norms' inputs and outputs, q, k and v after rope and the kv-heads' repeat, the attention
    output and the contiguous copies the attention kernel takes, the SwiGLU's four ffn-wide tensors."""
    return 10 * m.dim + 4 * m.ffn_hidden_dim


def pipeline_chunks_in_flight(p: ParallelismConfig, microbatches: int) -> int:
    """Stage-microbatches whose activations a pipeline's first rank holds at its peak, as torch's
    schedules order their work: every microbatch under GPipe and, per stage, under LoopedBFS; one
    per stage ahead of it under 1F1B; under the interleaved schedules (v stages per rank) their
    warm-up, (v-1)·pp + 2·(pp-1) forwards, and the first steady one; under the V-shaped ones, 2·pp."""
    pp, schedule = p.pipeline_parallel_degree, p.pipeline_parallel_schedule
    if pp == 1:
        return 1
    if schedule == "GPipe":
        return microbatches
    if schedule in SINGLE_STAGE_SCHEDULES:
        return min(pp, microbatches)
    v = 2
    if schedule == "LoopedBFS":
        return microbatches * v
    if schedule in V_SHAPED_SCHEDULES:
        return min(microbatches * v, 2 * pp)
    return min(microbatches * v, (v - 1) * pp + 2 * (pp - 1) + 1)


def pipeline_in_flight(p: ParallelismConfig, microbatches: int) -> float:
    """The same in microbatches through all of the rank's layers (a stage holds 1/v of them)."""
    single = p.pipeline_parallel_schedule in SINGLE_STAGE_SCHEDULES or p.pipeline_parallel_degree == 1
    return pipeline_chunks_in_flight(p, microbatches) / (1 if single else 2)


def gathered_kv(m: Llama3Config, batch: int, seq_len: int, cp: int) -> float:
    """Elements of other cp ranks' K and V one attention layer holds under context parallelism:
    gathered over the cp ranks and repeated to every query head, kept for the layer's backward (the
    all-gather attention; torch's ring attention with its all-gather rotation is alike)."""
    return batch * seq_len * (1 - 1 / cp) * 2 * m.n_heads * m.head_dim


def part_parameters(m: Llama3Config, pp: int, layers: int) -> int:
    """Parameters of the busiest rank's model part before sharding: the whole model without a
    pipeline; under one, its `layers` and the embeddings (the first stage)."""
    return model_parameters(m) if pp == 1 else layers * layer_parameters(m) + m.vocab_size * m.dim


def model_parameters(m: Llama3Config) -> int:
    """Every parameter of the model (a tied output counted once)."""
    outside_layers = m.vocab_size * m.dim * (1 if m.tie_word_embeddings else 2) + m.dim
    return m.n_layers * layer_parameters(m) + outside_layers


def rank_memory(
    m: Llama3Config,
    p: ParallelismConfig,
    local_batch_size: int,
    seq_len: int,
    activation_dtype: str,
    ac: ActivationCheckpointConfig,
    on_cpu: bool,
) -> RankMemory:
    """The peak of the busiest rank (the first pipeline stage) of a layout whose degrees are
    resolved: every shard the same size, the embeddings with the first stage's layers."""
    pp, tp, cp = p.pipeline_parallel_degree, p.tensor_parallel_degree, p.context_parallel_degree
    shards = p.data_parallel_shard_degree * cp if p.data_parallel_shard_degree * cp > 1 else 1
    layers = math.ceil(m.n_layers / pp)
    held = part_parameters(m, pp, layers)
    params_here = held / (tp * shards)
    act_bytes = DTYPE_BYTES[activation_dtype]
    microbatch = p.pipeline_parallel_microbatch_size if pp > 1 else local_batch_size
    tokens = microbatch * seq_len / cp
    per_layer = tokens * saved_per_token(m) * act_bytes / tp + gathered_kv(m, microbatch, seq_len, cp) * act_bytes / tp
    if ac.mode == "full":  # each layer keeps its input; one layer is recomputed at a time
        kept = layers * tokens * m.dim * act_bytes / tp + per_layer
    elif ac.mode == "selective":  # per-op SAC keeps attention and every other matmul output: ~30% (dry run's)
        kept = layers * per_layer * 0.3 + per_layer
    else:
        kept = layers * per_layer
    in_flight = pipeline_in_flight(p, local_batch_size // microbatch)
    # float32 logits, the loss's log-softmax of them, and their gradient.
    logits = local_batch_size * seq_len / cp * m.vocab_size / tp * 4 * 3
    # Under FSDP: two layers' gathered parameters (the current one and the prefetched next) and a
    # layer's gradients before their reduce-scatter.
    gathered = 3 * layer_parameters(m) / tp * _PARAM_BYTES if shards > 1 else 0
    # Under pipelining a microbatch's backward runs before the last one's forward: the stage's
    # gradients exist at the peak, under FSDP unreduced (PipelineStage syncs after the last one).
    grad_bytes = held / tp * act_bytes if shards > 1 and pp > 1 else params_here * _GRAD_BYTES
    slack = _CPU_ALLOCATOR_SLACK if on_cpu else 1.0
    return RankMemory(
        parameters=int(params_here * _PARAM_BYTES * slack),
        gradients=int(grad_bytes * slack),
        optimizer_state=int(params_here * _ADAM_BYTES * slack),
        activations=int(kept * in_flight * slack),
        logits=int(logits * slack),
        # During a layer's backward: its activations' gradients.
        temporaries=int(per_layer * slack),
        communication=int(gathered * slack),
        process=CPU_RANK_BASELINE_BYTES if on_cpu else 0,
    )

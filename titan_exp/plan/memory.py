"""An analytic estimate of what one rank holds at its peak, from the model's shape and the layout
alone (no torch, so the launching process can make it): parameters, gradients and optimizer state
as sharded by the layout, activations as kept by the schedule and activation checkpointing, the
float32 logits of the loss, and what a process holds before any tensor. The pre-flight check holds
it against the memory the ranks can have (config/check.py). A first model of the planner's
(issue 13 refines it and measures its accuracy); it errs on the high side."""

import dataclasses
import math
from dataclasses import dataclass

from titan_exp.models.llama3.args import Llama3Config
from titan_exp.parallel.config import ActivationCheckpointConfig, ParallelismConfig

GIB = 1024**3
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


def gathered_kv(m: Llama3Config, batch: int, seq_len: int, cp: int) -> float:
    """Elements of other cp ranks' K and V one attention layer holds under context parallelism:
    gathered over the cp ranks and repeated to every query head, kept for the layer's backward (the
    all-gather attention; torch's ring attention with its all-gather rotation is alike)."""
    return batch * seq_len * (1 - 1 / cp) * 2 * m.n_heads * m.head_dim


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
    # Without a pipeline a rank holds (a shard of) the whole model; the first stage, its layers and the embeddings.
    held = model_parameters(m) if pp == 1 else layers * layer_parameters(m) + m.vocab_size * m.dim
    params_here = held / (tp * shards)
    act_bytes = DTYPE_BYTES[activation_dtype]
    microbatch = p.pipeline_parallel_microbatch_size if pp > 1 else local_batch_size
    tokens = microbatch * seq_len / cp
    per_layer = tokens * saved_per_token(m) * act_bytes / tp + gathered_kv(m, microbatch, seq_len, cp) * act_bytes / tp
    if ac.mode == "full":  # each layer keeps its input; one layer is recomputed at a time
        kept = layers * tokens * m.dim * act_bytes / tp + per_layer
    elif ac.mode == "selective":
        kept = layers * per_layer / 2
    else:
        kept = layers * per_layer
    # A pipeline's first stage holds the activations of the microbatches in flight: all of them
    # under GPipe, up to one per stage under the 1F1B family.
    microbatches = local_batch_size // microbatch
    in_flight = 1 if pp == 1 else microbatches if p.pipeline_parallel_schedule == "GPipe" else min(pp, microbatches)
    # float32 logits, the loss's log-softmax of them, and their gradient.
    logits = local_batch_size * seq_len / cp * m.vocab_size / tp * 4 * 3
    # During a layer's backward: its activations' gradients; under FSDP, two layers' gathered
    # parameters (the current one and the prefetched next).
    gathered = 2 * layer_parameters(m) / tp * _PARAM_BYTES if shards > 1 else 0
    slack = _CPU_ALLOCATOR_SLACK if on_cpu else 1.0
    return RankMemory(
        parameters=int(params_here * _PARAM_BYTES * slack),
        gradients=int(params_here * _GRAD_BYTES * slack),
        optimizer_state=int(params_here * _ADAM_BYTES * slack),
        activations=int(kept * in_flight * slack),
        logits=int(logits * slack),
        temporaries=int((per_layer + gathered) * slack),
        process=CPU_RANK_BASELINE_BYTES if on_cpu else 0,
    )

"""An analytic model of one training step's time on the busiest rank (torch-free): compute from
FLOPs and the device's peak (or from times measured on this machine, plan/measure.py), plus the
collectives each layout runs from their message sizes and the links' bandwidths, plus the
pipeline schedule's bubble.

Per microbatch, a rank runs its layers' forward and backward (forward again for recomputation
under activation checkpointing), and its layout's collectives:
- FSDP: all-gather of each unit's parameters in forward and again in backward (resharded after
  forward), reduce-scatter of its gradients (the last microbatch only);
- DDP / HSDP's replicas: an all-reduce of the gradients (the last microbatch only);
- tensor + sequence parallel: per layer, an all-gather and a reduce-scatter of the activations
  around attention and around the MLP, in forward and in backward;
- context parallel: an all-gather of K and V per layer, a reduce-scatter of their gradients;
- pipeline: a send and a receive of activations (forward) and of their gradients (backward) per
  stage boundary; the schedule leaves each rank idle for its bubble.
On GPUs FSDP's and DDP's collectives overlap compute (only what exceeds it shows); on CPU ranks
(gloo) every collective blocks.
"""

import dataclasses
import math
from dataclasses import dataclass

from titan_exp.estimate.config import HardwareConfig
from titan_exp.estimate.memory import layer_parameters, part_parameters
from titan_exp.models.llama3.args import Llama3Config
from titan_exp.parallel.config import ParallelismConfig
from titan_exp.parallel.stages import StagePlan

# Extra forward work of activation checkpointing, as a fraction of the forward: full recomputes
# every layer; torchtitan's selective "op" policy recomputes what is not a matmul or attention.
_RECOMPUTE = {"none": 0.0, "full": 1.0, "selective": 0.25}
# Bubble of a schedule as a fraction of its useful work, with v stages per rank and m microbatches:
# (pp - 1) / (v·m) for the 1F1B family and GPipe; the zero-bubble schedules fill most of it.
_ZERO_BUBBLE_SHARE = {"InterleavedZeroBubble": 0.25, "ZBVZeroBubble": 0.25, "DualPipeV": 0.25}


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds of one rank's compute for one microbatch: a transformer layer's forward and backward
    (with any recomputation), the output head's (norm, output matmul, loss); and the optimizer step
    (once per step)."""

    layer: float
    head: float
    optimizer: float


@dataclass(frozen=True)
class StepBatch:
    """What one rank's step processes: its local batch of sequences, the microsteps whose gradients
    accumulate, and the bytes per element of the parameters and of the activations it sends."""

    local_batch_size: int
    seq_len: int
    accumulation: int
    param_bytes: int
    activation_bytes: int


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on the busiest rank."""

    compute: float
    communication: float  # what shows: blocking collectives, and what overlapped ones exceed compute by
    bubble: float
    oversubscription: float  # CPU ranks sharing cores: the factor their time stretches by

    @property
    def total(self) -> float:
        return (self.compute + self.communication + self.bubble) * self.oversubscription

    def breakdown(self) -> dict[str, float]:
        return dataclasses.asdict(self) | {"total": self.total}


def modelled_compute(
    m: Llama3Config, hw: HardwareConfig, microbatch: tuple[float, int], tp: int, matmul_dtype: str, ac_mode: str,
    local_params: float,
) -> ComputeTimes:  # fmt: skip
    """From FLOPs at the device's peak × efficiency: 2 FLOPs per multiply-add in forward, twice that
    in backward; attention's score and value matmuls over the causal sequence (counted in full, as
    MFU counts them); `microbatch`: (tokens, sequence length). The optimizer step moves ~32 bytes
    per local parameter at the memory bandwidth."""
    tokens, seq_len = microbatch
    rate = hw.peak_flops(matmul_dtype) * hw.compute_efficiency
    attention_rate = hw.peak_flops("bfloat16" if matmul_dtype == "float8" else matmul_dtype) * hw.compute_efficiency
    linear = 2 * tokens * layer_parameters(m) / tp / rate
    forward = linear + 4 * tokens * seq_len * m.n_heads * m.head_dim / tp / attention_rate
    return ComputeTimes(
        layer=forward * (3 + _RECOMPUTE[ac_mode]),
        head=6 * tokens * m.dim * m.vocab_size / tp / rate,
        optimizer=32 * local_params / (hw.memory_gbps * 1e9),
    )


def _collective(hw: HardwareConfig, bytes_per_rank: float, group: int, spans_nodes: bool, kind: str) -> float:
    """Seconds of one collective over `group` ranks, ring algorithm: all-gather / reduce-scatter move
    (g-1)/g of the full buffer through each rank's link, an all-reduce twice that."""
    if group <= 1:
        return 0.0
    bandwidth = (hw.inter_node_gbps if spans_nodes else hw.intra_node_gbps) * 1e9
    traffic = bytes_per_rank * (group - 1) / group * (2 if kind == "all_reduce" else 1)
    latency = hw.collective_latency_us if kind == "all_gather" else hw.reduce_latency_us
    return latency * 1e-6 + traffic / bandwidth


def step_time(
    m: Llama3Config,
    p: ParallelismConfig,
    hw: HardwareConfig,
    compute: ComputeTimes,
    batch: StepBatch,
    oversubscription: float = 1.0,
) -> StepTime:
    """The busiest rank's step (degrees resolved): `compute` is per microbatch of this layout."""
    local_batch_size, seq_len, accumulation = batch.local_batch_size, batch.seq_len, batch.accumulation
    param_bytes, activation_bytes = batch.param_bytes, batch.activation_bytes
    pp, tp, cp = p.pipeline_parallel_degree, p.tensor_parallel_degree, p.context_parallel_degree
    shard, replicate = p.data_parallel_shard_degree * cp, p.data_parallel_replicate_degree
    plan = StagePlan.from_config(p, m.n_layers)
    layers = math.ceil(m.n_layers / plan.num_stages) * plan.stages_per_rank
    microbatch = p.pipeline_parallel_microbatch_size if pp > 1 else local_batch_size
    microbatches = (local_batch_size // microbatch) * accumulation
    # The busiest rank: its layers, and the output head (the last stage's; under the V schedules rank 0's).
    per_microbatch = layers * compute.layer + compute.head
    work = microbatches * per_microbatch + compute.optimizer

    # Which links a group crosses: tp innermost, then cp, dp_shard, dp_replicate, pp outermost.
    def spans(inner: int, size: int) -> bool:
        return inner * size > hw.devices_per_node

    held = part_parameters(m, pp, layers) / tp
    blocking, overlappable = 0.0, 0.0
    units = layers + (2 if pp == 1 else 1)  # one FSDP unit per layer, the embeddings, norm + output
    if shard > 1:
        unit_bytes = held * param_bytes / units
        # Forward, and again in backward: all but the last layer and the output, kept gathered.
        gathers = (2 * units - 2) * microbatches
        gather = _collective(hw, unit_bytes, shard, spans(tp, shard), "all_gather")
        scatter = _collective(hw, held * 4 / units, shard, spans(tp, shard), "reduce_scatter")
        overlappable += gathers * gather + units * scatter
    if replicate > 1:
        overlappable += _collective(hw, held / shard * 4, replicate, spans(tp * shard, replicate), "all_reduce")
    if tp > 1:
        activation = microbatch * seq_len / cp * m.dim * activation_bytes
        per_layer = 8 * _collective(hw, activation, tp, spans(1, tp), "all_gather")
        blocking += microbatches * (layers * per_layer + 2 * _collective(hw, activation, tp, False, "all_gather"))
    if cp > 1:
        kv = microbatch * seq_len / cp * 2 * m.kv_heads * m.head_dim / tp * activation_bytes
        blocking += microbatches * layers * 2 * _collective(hw, kv * cp, cp, spans(tp, cp), "all_gather")
    if pp > 1:
        boundary = microbatch * seq_len / cp / tp * m.dim * activation_bytes
        hops = 2 * plan.stages_per_rank  # send forward + receive backward, per stage held
        latency = hw.collective_latency_us * 1e-6
        blocking += microbatches * hops * (latency + boundary / (hw.intra_node_gbps * 1e9))
    # Step-level: the loss and grad-norm reductions.
    if math.prod(p.degrees().values()) > 1:
        blocking += 3 * hw.collective_latency_us * 1e-6
    communication = blocking + (max(0.0, overlappable - work) if hw.overlaps_communication else overlappable)
    bubble = 0.0
    if pp > 1:
        share = _ZERO_BUBBLE_SHARE.get(p.pipeline_parallel_schedule, 1.0)
        bubble = share * (pp - 1) / (plan.stages_per_rank * microbatches) * (work - compute.optimizer)
    return StepTime(compute=work, communication=communication, bubble=bubble, oversubscription=oversubscription)

"""An analytic model of one training step's time on the busiest rank (torch-free): compute per
microbatch (modelled op by op on a GPU, estimate/gpu_compute.py, or measured on CPU ranks,
plan/measure.py), plus the collectives each layout runs (each priced as NCCL or gloo runs it:
estimate/collectives.py), less what overlaps compute, plus the pipeline schedule's bubble.

Per microbatch, a rank runs its layers' forward and backward (forward again for recomputation
under activation checkpointing), and its layout's collectives:
- FSDP: each unit's all-gather in forward and again in backward (resharded after forward), its
  gradients' reduce-scatter in backward (every microbatch, or the last only under
  training.gradient_sync=last_microbatch: `Workload.gradient_reductions`). On GPUs they run on their own
  streams, prefetched one unit ahead: per unit, only what exceeds that unit's compute shows, and
  the first all-gather and the last reduce-scatter, which nothing covers; the copies around
  them (a gathered unit out of its flat buffer, gradients into the reduce-scatter's input) run on
  the compute stream, bandwidth-bound, with the compute;
- DDP / HSDP's replicas: an all-reduce of the gradients (as often as FSDP reduces), overlapped
  with the backward;
- tensor + sequence parallel: per layer, an all-gather and a reduce-scatter of the activations
  around attention and around the MLP, in forward, in backward and in recomputation; blocking,
  unless async TP, which splits each into chunks hidden behind the linear that consumes or
  produces them (torch's micro-pipelined `fused_all_gather_matmul` / `fused_matmul_reduce_scatter`);
- context parallel: K and V of the other ranks per layer (and their gradients back): the
  all-gather attention blocks; torch's ring attention passes them on while it computes;
- pipeline: a send and a receive of activations (forward) and of their gradients (backward) per
  stage boundary; the schedule leaves each rank idle for its bubble;
- expert parallel: per MoE layer, the routed rows (top_k per token) sent to their experts' ranks
  and back by all-to-all in forward, their gradients in backward (and again under full
  recomputation), blocking; the busiest rank's share stretched by plan.expert_load_imbalance, as
  is its experts' compute. FSDP gathers a rank's own experts only, over the ranks EP leaves.
On CPU ranks (gloo, `overlaps_communication: false`) every collective blocks.
"""

import dataclasses
import math
from dataclasses import dataclass

from titan_exp.estimate.collectives import Kind, collective_seconds, point_to_point_seconds
from titan_exp.estimate.config import HardwareConfig
from titan_exp.estimate.workload import (
    DTYPE_BYTES,
    Workload,
    layer_parameters,
    part_parameters,
    pipeline_ranks,
    routed_expert_parameters,
    unit_parameters,
)
from titan_exp.parallel.config import ActivationCheckpointConfig, ParallelismConfig
from titan_exp.parallel.stages import StagePlan

# Bubble of a schedule as a fraction of its useful work, with v stages per rank and m microbatches:
# (pp - 1) / (v·m) for the 1F1B family and GPipe; the zero-bubble schedules fill most of it.
_ZERO_BUBBLE_SHARE = {"InterleavedZeroBubble": 0.25, "ZBVZeroBubble": 0.25, "DualPipeV": 0.25}
# Under sequence parallelism a layer runs, per microbatch and direction, an all-gather before
# attention and before the MLP and a reduce-scatter after each: two pairs.
_TP_PAIRS = 2
# The share of the hideable TP collectives async TP hides in practice: torchtitan's published async
# TP runs (torchtitan's benchmarks/asyncTP_*_h100_2025-06) gain 9-16%, about half of what hiding every
# transfer behind its matmul would give on the same links.
_ASYNC_TP_OVERLAP = 0.5


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds of one rank's compute for one microbatch: a transformer layer's forward and backward
    (with any recomputation), the output head's (norm, output matmul, loss); and the optimizer step
    (once per step)."""

    layer: float
    head: float
    optimizer: float
    # Whether `layer` already runs the busiest EP rank's routed rows (plan.expert_load_imbalance), as
    # the GPU model prices them (estimate/gpu_compute.py); a measured layer runs the rows it drew.
    imbalanced: bool = False


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on the busiest rank."""

    compute: float
    communication: float  # what shows: blocking collectives, and what overlapped ones exceed compute by
    bubble: float
    oversubscription: float  # CPU ranks sharing cores: the factor their busy time stretches by

    @property
    def total(self) -> float:
        busy = self.compute + self.communication
        # A pipeline rank idle in its bubble lends its core to the ranks sharing it: the bubble
        # shows only where it outlasts what the sharing stretches the busy time by.
        return max(busy * self.oversubscription, busy + self.bubble)

    def breakdown(self) -> dict[str, float]:
        return dataclasses.asdict(self) | {"total": self.total}


def step_time(w: Workload, hw: HardwareConfig, compute: ComputeTimes, oversubscription: float = 1.0) -> StepTime:
    """The busiest rank's step (degrees resolved): `compute` is per microbatch of this layout."""
    m, p = w.model, w.parallelism
    plan = StagePlan.from_config(p, m.n_layers)
    # The busiest rank's layers (all of them without a pipeline), as the trainer cuts stages.
    layers = max(rank.layers for rank in pipeline_ranks(p, m.n_layers).values())
    microbatches = (w.local_batch_size // w.microbatch) * w.accumulation
    # The busiest rank: its layers, and the output head (the last stage's; under the V schedules rank 0's).
    per_microbatch = layers * compute.layer + compute.head
    work = microbatches * per_microbatch + compute.optimizer
    links = _Links(hw, p, w.experts_tp)
    blocking = _tensor_parallel(w, links, compute, layers, microbatches)
    blocking += _context_parallel(w, links, layers, microbatches)
    blocking += _expert_parallel(w, links, layers, microbatches)
    if not compute.imbalanced:
        work += microbatches * layers * compute.layer * _expert_share(w) * (w.busiest_rank_rows - 1)
    work += _fsdp_copies(w, hw, layers, microbatches)
    overlapped = _data_parallel(w, links, compute, layers, microbatches)
    if p.pipeline_parallel_degree > 1:
        boundary = w.tokens / p.tensor_parallel_degree * m.dim * DTYPE_BYTES[w.param_dtype]
        hops = 2 * plan.stages_per_rank  # send forward + receive backward, per stage held
        blocking += microbatches * hops * links.send(boundary)
    # Step-level: the loss and grad-norm reductions.
    if (world := math.prod(p.degrees().values())) > 1:
        blocking += 3 * collective_seconds(hw, DTYPE_BYTES["float32"], world, 1, "all_reduce")
    bubble = 0.0
    if p.pipeline_parallel_degree > 1:
        share = _ZERO_BUBBLE_SHARE.get(p.pipeline_parallel_schedule, 1.0)
        pp = p.pipeline_parallel_degree
        bubble = share * (pp - 1) / (plan.stages_per_rank * microbatches) * (work - compute.optimizer)
    return StepTime(compute=work, communication=blocking + overlapped, bubble=bubble, oversubscription=oversubscription)


@dataclass(frozen=True)
class _Links:
    """Which links each mesh dimension's groups cross: tp innermost, then cp, dp_shard, dp_replicate,
    pp outermost; a group spans nodes when it and the dimensions inside it exceed a node."""

    hw: HardwareConfig
    p: ParallelismConfig
    experts_tp: int  # Workload.experts_tp

    def send(self, size: float) -> float:
        """One pipeline send: to the next pp rank, across nodes once the inner dimensions fill one."""
        p, hw = self.p, self.hw
        inner = math.prod(p.degrees().values()) // p.pipeline_parallel_degree
        return point_to_point_seconds(hw, size, across_nodes=inner * 2 > hw.devices_per_node)

    def collective(self, bytes_per_rank: float, dim: str, kind: Kind) -> float:
        p = self.p
        sizes = {
            "tp": (1, p.tensor_parallel_degree),
            "cp": (p.tensor_parallel_degree, p.context_parallel_degree),
            "dp_shard": (p.tensor_parallel_degree, p.data_parallel_shard_degree * p.context_parallel_degree),
            "dp_replicate": (
                p.tensor_parallel_degree * p.data_parallel_shard_degree * p.context_parallel_degree,
                p.data_parallel_replicate_degree,
            ),
            # EP's ranks are the innermost (tp, cp, then dp_shard's; outside tp where TP splits the
            # experts); each expert's FSDP ranks lie outside them.
            "ep": (self.experts_tp, p.expert_parallel_degree),
            "expert_shard": (
                p.expert_parallel_degree * self.experts_tp,
                p.data_parallel_shard_degree
                * p.context_parallel_degree
                * p.tensor_parallel_degree
                // (p.expert_parallel_degree * self.experts_tp),
            ),
        }
        inner, group = sizes[dim]
        return collective_seconds(self.hw, bytes_per_rank, group, inner, kind)


def _tensor_parallel(w: Workload, links: _Links, compute: ComputeTimes, layers: int, microbatches: int) -> float:
    """What TP's activation collectives add (async TP: what the linears do not cover)."""
    p = w.parallelism
    if p.tensor_parallel_degree == 1:
        return 0.0
    m = w.model
    activation = w.tokens * m.dim * DTYPE_BYTES[w.param_dtype]
    # Float8 TP (tensorwise: torchao's Float8ColwiseParallel, parallel/tensor_parallel.py) casts a
    # column-wise linear's input before gathering it: forward (and recomputation) all-gathers move
    # one byte an element; the reduce-scatters and backward's collectives the param dtype.
    gathered_bytes = w.tokens * m.dim * (1 if w.quantize == "tensorwise" else DTYPE_BYTES[w.param_dtype])
    # Forward's all-gathers and reduce-scatters, each once more where checkpointing recomputes it:
    # full AC both; per-op SAC the all-gathers (parallel/activation_checkpoint.py saves the
    # reduce-scatters' outputs, not the gathered inputs wk and w3 recompute from); every N-th
    # block both, in one block of N. In backward each all-gather turns into a reduce-scatter and
    # each reduce-scatter into an all-gather.
    again = _recomputed_tp_collectives(w.ac)
    gathers, scatters, backwards = 1 + again[0], 1 + again[1], 1.0
    if m.moe.enabled and w.experts_tp == 1:
        # A MoE layer whose experts EP spreads over the tp ranks routes each rank's sequence slice:
        # no all-gather or reduce-scatter around it, half of a dense layer's.
        dense_share = 1 - m.num_moe_layers / m.n_layers / 2
        gathers, scatters, backwards = gathers * dense_share, scatters * dense_share, dense_share
    gather, scatter = (links.collective(activation, "tp", kind) for kind in ("all_gather", "reduce_scatter"))
    fp8_gather = links.collective(gathered_bytes, "tp", "all_gather")
    per_layer = _TP_PAIRS * (gathers * fp8_gather + scatters * scatter + backwards * (gather + scatter))
    if not (w.async_tp and links.hw.overlaps_communication):
        # torch's functional collectives gather along the sequence (dim 1) by gathering along dim 0
        # and re-concatenating, a copy of the whole gathered tensor unless the batch is 1 (then a
        # view: torch/_utils.py, _maybe_view_chunk_cat), and make a reduce-scatter's input
        # contiguous the same way, always (_chunk_or_narrow_cat): each copy reads and writes it.
        # (Async TP's fused matmuls gather and scatter chunk by chunk in place.)
        gathered_copies = (gathers * gathered_bytes + backwards * activation) * (w.microbatch > 1)
        copied = _TP_PAIRS * (gathered_copies + (scatters + backwards) * activation)
        per_layer += 2 * copied / links.hw.memory_bytes_per_second()
    if w.async_tp and links.hw.overlaps_communication:
        # Hidden behind the linears that consume or produce them, split into tp chunks: the first
        # chunk's transfer is never hidden, and the chunked matmuls and the copy engines' traffic
        # slow what overlaps (torch's micro-pipelined TP reaches about half: _ASYNC_TP_OVERLAP).
        hidden = min(per_layer * (1 - 1 / p.tensor_parallel_degree), compute.layer) * _ASYNC_TP_OVERLAP
        per_layer -= hidden
    head = 2 * links.collective(activation, "tp", "all_gather")
    return microbatches * (layers * per_layer + head)


def _recomputed_tp_collectives(ac: ActivationCheckpointConfig) -> tuple[float, float]:
    """(all-gathers, reduce-scatters) of a layer's forward that checkpointing runs again, as shares."""
    if ac.mode == "full":
        return 1.0, 1.0
    if ac.mode == "selective":
        if ac.selective_ac_option == "op":
            return 1.0, 0.0
        return 1 / int(ac.selective_ac_option), 1 / int(ac.selective_ac_option)
    return 0.0, 0.0


def _context_parallel(w: Workload, links: _Links, layers: int, microbatches: int) -> float:
    p = w.parallelism
    if p.context_parallel_degree == 1:
        return 0.0
    m, cp = w.model, p.context_parallel_degree
    kv = w.tokens * 2 * m.kv_heads * m.head_dim / p.tensor_parallel_degree * DTYPE_BYTES[w.param_dtype]
    return microbatches * layers * 2 * links.collective(kv * cp, "cp", "all_gather")


def _expert_parallel(w: Workload, links: _Links, layers: int, microbatches: int) -> float:
    """The all-to-alls of a rank's MoE layers: dispatch and combine, forward and backward."""
    m, p = w.model, w.parallelism
    if p.expert_parallel_degree == 1:
        return 0.0
    moe_layers = layers * m.num_moe_layers / m.n_layers
    # Each tp rank sends its sequence slice's rows, or, where TP splits the experts, every tp rank's.
    tokens = w.tokens / p.tensor_parallel_degree * w.experts_tp
    rows = tokens * m.moe.top_k * w.busiest_rank_rows
    exchanges = 4 + (2 if w.ac.mode == "full" else 0)
    return (
        microbatches
        * moe_layers
        * exchanges
        * links.collective(rows * m.dim * DTYPE_BYTES[w.param_dtype], "ep", "all_to_all")
    )


def _expert_share(w: Workload) -> float:
    """The routed experts' share of a layer's compute (by active parameters: their matmuls dominate)."""
    m = w.model
    if not m.moe.enabled or w.busiest_rank_rows == 1:
        return 0.0
    routed = routed_expert_parameters(m) * m.moe.top_k / m.moe.num_experts
    return routed / (layer_parameters(m) - routed_expert_parameters(m) + routed)


def _unit_collective(w: Workload, links: _Links, bytes_per_param: float, kind: str) -> float:
    """One layer unit's FSDP collective: its dense weights over dp_shard × cp, and under expert
    parallelism its experts over the ranks EP leaves (one group without EP)."""
    dense, experts = unit_parameters(w)
    if w.parallelism.expert_parallel_degree == 1:
        return links.collective((dense + experts) * bytes_per_param, "dp_shard", kind)
    dense_part = links.collective(dense * bytes_per_param, "dp_shard", kind)
    return dense_part + links.collective(experts * bytes_per_param, "expert_shard", kind)


def _outside_layers(w: Workload, layers: int) -> float:
    """Parameters a rank holds outside its `layers` blocks (embeddings, final norm, output), unsharded."""
    m, p = w.model, w.parallelism
    return (part_parameters(m, p) - layers * layer_parameters(m)) / p.tensor_parallel_degree


def _fsdp_copies(w: Workload, hw: HardwareConfig, layers: int, microbatches: int) -> float:
    """Seconds of the copies FSDP2 runs on the compute stream around its collectives, memory-bound:
    after each all-gather, the gathered flat buffer split into the unit's unsharded parameters
    (`foreach_all_gather_copy_out`: read and written once); before each reduce-scatter, the unit's
    unsharded gradients copied, cast to the reduce dtype, into its input (`foreach_reduce_scatter_copy_in`,
    on the current stream before the reduce-scatter stream waits on it). Torch's
    `_fully_shard/_fsdp_collectives.py`. The all-gather's own copy-in (a shard, 1/shards of this)
    runs on its own stream. Counted as the collectives are (`_data_parallel`): each layer gathered
    in forward and again in backward per microbatch, reduced `gradient_reductions` times a step."""
    if w.fsdp_shards == 1:
        return 0.0
    unit, outside = sum(unit_parameters(w)), _outside_layers(w, layers)
    param_bytes = DTYPE_BYTES[w.param_dtype]
    gathered = 1 if w.float8_all_gather else param_bytes  # the linears' weights; embeddings and head stay
    copied_out = 2 * (2 * layers * unit * gathered + outside * param_bytes) * microbatches
    copied_in = (param_bytes + DTYPE_BYTES[w.reduce_dtype]) * (layers * unit + outside) * w.gradient_reductions
    return (copied_out + copied_in) / hw.memory_bytes_per_second()


def _data_parallel(w: Workload, links: _Links, compute: ComputeTimes, layers: int, microbatches: int) -> float:
    """What FSDP's and the replicas' collectives add: all of them where they block (gloo); on GPUs
    per unit what exceeds the unit's compute, plus the first gather and the last reduce-scatter."""
    m, p = w.model, w.parallelism
    shard = p.data_parallel_shard_degree * p.context_parallel_degree
    held = part_parameters(m, p) / p.tensor_parallel_degree
    replicas = links.collective(held / max(1, shard) * DTYPE_BYTES[w.reduce_dtype], "dp_replicate", "all_reduce")
    param_bytes, reduce_bytes = DTYPE_BYTES[w.param_dtype], DTYPE_BYTES[w.reduce_dtype]
    reductions = w.gradient_reductions
    if not links.hw.overlaps_communication:
        if shard == 1:
            return reductions * replicas
        # One unit per layer and the root, which holds the embeddings, norm and output on gloo
        # (parallel/data_parallel.py; held evenly, as the blocks dominate); all but the last layer
        # and the root gathered again in backward.
        units = layers + 1
        if p.expert_parallel_degree > 1:
            # The layers' units gather only a rank's own experts: counted apart from the others.
            outside = _outside_layers(w, layers) / (units - layers)
            gather = links.collective(outside * param_bytes, "dp_shard", "all_gather")
            scatter = links.collective(outside * reduce_bytes, "dp_shard", "reduce_scatter")
            layer_gather = _unit_collective(w, links, param_bytes, "all_gather")
            layer_scatter = _unit_collective(w, links, reduce_bytes, "reduce_scatter")
            gathers = (2 * layers - 1) * layer_gather + (2 * (units - layers) - 1) * gather
            scatters = layers * layer_scatter + (units - layers) * scatter
            return microbatches * gathers + reductions * (scatters + replicas)
        gather = links.collective(held * param_bytes / units, "dp_shard", "all_gather")
        scatter = links.collective(held * reduce_bytes / units, "dp_shard", "reduce_scatter")
        return (2 * units - 2) * microbatches * gather + reductions * (units * scatter + replicas)
    exposed = reductions * max(0.0, replicas - compute.layer * layers)
    if shard == 1:
        return exposed
    gather = _unit_collective(w, links, 1 if w.float8_all_gather else param_bytes, "all_gather")
    scatter = _unit_collective(w, links, reduce_bytes, "reduce_scatter")
    # Embeddings and head: gathered in forward, behind the head's compute.
    outside = _outside_layers(w, layers)
    head = links.collective(outside * param_bytes, "dp_shard", "all_gather")
    # A microbatch's share of the reduce-scatters (all of them where each microbatch reduces).
    scatter_share = reductions / microbatches
    head += links.collective(outside * reduce_bytes, "dp_shard", "reduce_scatter") * scatter_share
    # Per microbatch: each unit's gather behind the previous unit's forward (~1/3 of a layer's
    # compute), the first one behind nothing; in backward each gather (the last layer stays
    # gathered) and, on a microbatch that reduces, each reduce-scatter behind a layer's backward
    # (the rest, recomputation included), the last reduce-scatter behind nothing.
    forward = gather + (layers - 1) * max(0.0, gather - compute.layer / 3)
    scatter *= scatter_share
    backward = (layers - 1) * max(0.0, gather + scatter - 2 * compute.layer / 3) + scatter
    return exposed + microbatches * (forward + backward + max(0.0, head - compute.head))

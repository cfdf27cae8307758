"""The memory model: what one rank holds at its peak, from the model's shape and the layout alone
(no torch, so the launching process can make it). The planner, the pre-flight check and a sweep's
pruning all read this one model; the dry run's fake pass is the planner's cross-check.

Per rank it predicts two figures, as a run reports them (metrics/memory.py):
- **active**: live tensors at the peak (CUDA: the caching allocator's `active_bytes.all.peak`; CPU:
  tensor-level accounting, what torch's MemTracker counts);
- **reserved**: what the process takes from the device (CUDA: `reserved_bytes.all.peak`; CPU: its
  resident set), the figure a fit is judged on.

The peak is the larger of two moments of a step, each summed term by term (`Phase`):
- *loss backward*: every layer's saved activations, the float32 logits and their gradient, the
  head's gathered weights; gradients only where earlier microbatches left some (accumulation,
  pipelining): sharded ones, or under `training.gradient_sync=last_microbatch` FSDP's unsharded
  ones for every unit;
- *end of backward*: the first layer's backward (its recomputation, gradient temporaries, FSDP's
  gathered and unreduced buffers) beside the full sharded gradients.
Under pipelining a rank's peak is its steady state, with the schedule's microbatches in flight;
every pipeline rank is modelled (its stages as the trainer cuts them) and the largest kept.

Each term, with its source:
- the rotary embeddings' table (a buffer, complex64 up to max_seq_len);
- float32 master weights, gradients and AdamW's two moments, sharded over dp_shard × cp (FSDP2
  keeps sharded parameters in their dtype and casts only what it all-gathers: torch's
  `MixedPrecisionPolicy`; AdamW's `exp_avg`, `exp_avg_sq`);
- activations per token and layer, by kernel and checkpointing (`layer_activations`), counted on
  this model's ops: what each op saves for backward (torch's derivatives.yaml; SDPA's flash and
  efficient kernels save q, k, v, the output and the log-sum-exp, not the score matrix; its math
  path, which latent attention takes on a CPU, keeps the probabilities; on a CPU RMSNorm is
  composed of pointwise ops and keeps its normalized input too; a MoE layer keeps its routed rows
  twice and their int64 indices; on this CPU the count is what autograd saves per block within 1%,
  tests/unit/test_unit_memory_estimate.py); selective "op" checkpointing saves the outputs of
  every other matmul, attention and reduce-scatter (torchtitan's policy,
  parallel/activation_checkpoint.py); with tensor parallelism the layers run sequence parallel,
  so only the all-gathered inputs of the column-wise linears and the row-wise linears' partial
  outputs are whole;
- logits: `cross_entropy(logits.float())` keeps a float32 copy, the log-softmax output and its
  gradient at once (12 bytes per token and vocabulary entry, vocabulary sharded under TP); compiled
  (train/loss.py), the logits and their gradient in the param dtype;
- FSDP2's buffers: the running unit's and the prefetched unit's all-gathered weights, a unit's
  unsharded gradient and its reduce-scatter input in the reduce dtype; the last block and the head
  stay gathered after forward; under pipelining the rank's stages stay gathered and their
  gradients accumulate unsharded in the reduce dtype until the last microbatch (torch's
  PipelineStage sets `set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)`;
  FSDPParam.to_accumulated_grad_if_needed upcasts to the reduce dtype);
- pipeline schedules: the stage-microbatches a rank keeps in flight (`pipeline_chunks_in_flight`,
  from torch's schedules' warm-up counts); where the step returns the last stage's outputs (torch's
  default; `plan.pipeline_returns_outputs`, not titan_exp's own step), every microbatch's logits,
  which torch's PipelineStage keeps until the step returns them merged (`output_chunks`);
- float8 (torchao): Float8Linear saves its high-precision input and weight, so activations do not
  change; its casts (float8 weight and input, one byte an element) are temporaries;
- torch.compile (per block): the partitioner recomputes pointwise work inside fused kernels, so a
  block keeps only matmul and attention inputs and outputs and its backward's temporaries shrink;
  under per-op SAC it saves the policy's outputs only where a backward reads them (not w2's);
- reserved beyond active: on CUDA the caching allocator reuses a block only on the stream it was
  allocated on, so each pool stands at its own high-water mark: FSDP2's sharded gradients (views of
  `foreach_reduce`'s output, on its reduce-scatter stream: `_fully_shard/_fsdp_collectives.py`) and
  the flat buffers of the last two units gathered (`foreach_all_gather`, copy-in stream) beside the
  compute stream's peak (the loss or the end of backward), which a step's gradients cannot reuse;
  with expandable segments (the ranks', as torchtitan's launch script) one largest transient block
  (the float32 logits, or a gathered unit) lies free in what is mapped; on a CPU, glibc keeps ~10%
  of freed memory and a process holds ~0.4 GiB before any tensor; beyond that, the profile's
  `allocator_slack` share of the live tensors (0 unless `plan calibrate` fitted it to your runs).
"""

import dataclasses
from dataclasses import dataclass

from titan_exp.estimate.moe_memory import ffn_kept, routed_rows
from titan_exp.estimate.workload import (
    DTYPE_BYTES,
    PipelineRank,
    Workload,
    gathered_parameters,
    layer_parameters,
    pipeline_chunks_in_flight,
    pipeline_ranks,
    unit_parameters,
)
from titan_exp.models.config import ModelConfig
from titan_exp.parallel.config import resolved_context_parallel_impl
from titan_exp.units import GIB

# fp32 master weights (4), their gradients (4), AdamW's two moments (8).
_PARAM_BYTES, _GRAD_BYTES, _ADAM_BYTES = 4, 4, 8
# What a rank holds before any tensor on a CPU: the interpreter, torch, the process group.
CPU_RANK_BASELINE_BYTES = int(0.4 * GIB)
# On a CPU a process's resident memory runs above its live tensors: glibc keeps freed blocks.
_CPU_ALLOCATOR_SLACK = 0.1
# float32 logits, their log-softmax and its gradient, live together in the loss's backward.
_LOGITS_BYTES = 3 * 4


@dataclass(frozen=True)
class RankMemory:
    """One rank at its peak, bytes by what holds them; `active` sums the tensors, `reserved` adds
    what the allocator and the process keep beyond them."""

    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int
    activations: int
    logits: int
    temporaries: int
    # FSDP's gathered units and unreduced gradients (under pipelining, the stages' whole).
    communication: int
    allocator: int
    process: int
    phase: str = ""

    @property
    def active(self) -> int:
        return self.total - self.allocator - self.process

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "phase")

    @property
    def reserved(self) -> int:
        return self.total

    def describe(self) -> str:
        parts = {f.name.replace("_", " "): getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "phase"}
        return " + ".join(f"{name} {size / GIB:.1f}" for name, size in parts.items() if size) + " GiB"


def rope_table_bytes(m: ModelConfig) -> int:
    """The rotary embeddings' table each model part keeps as a buffer: complex64 rotations for
    every position up to max_seq_len (models/common/rotary.py), whatever the sequence trained."""
    return m.max_seq_len * m.rope_dim // 2 * 8


def gathered_kv(m: ModelConfig, batch: int, seq_len: int, cp: int) -> float:
    """Elements of other cp ranks' K and V one attention layer holds under the all-gather context
    parallelism: gathered over the cp ranks and repeated to every query head, kept for the layer's
    backward."""
    return batch * seq_len * (1 - 1 / cp) * 2 * m.n_heads * m.head_dim


def layer_activations(w: Workload, mode: str) -> float:
    """Elements one token of the microbatch leaves in one layer for its backward, `mode` being
    none, full or op (selective per op). Whole: the gathered inputs of the column-wise linears
    (q/k/v and w1/w3 read one normed input each) and a row-wise linear's partial output; the rest
    is split over tp (sequence parallel, or heads and ffn columns)."""
    m, tp = w.model, w.parallelism.tensor_parallel_degree
    dim, kv, ffn = m.dim, m.kv_heads * m.head_dim, m.active_ffn_hidden_dim
    moe_share = m.num_moe_layers / m.n_layers
    if mode == "full":  # the block's input
        return dim / tp
    if mode == "op":
        # The block's input; outputs of wq, wv, w1, w2 (every other matmul, w2's whole), attention's
        # output; under TP the two reduce-scatters' outputs.
        reduce_scatters = 2 * dim / tp if tp > 1 else 0
        kept = dim + (3 * dim + kv + ffn) / tp + reduce_scatters
        if w.compiled:
            # The partitioner saves an output only where backward reads it: w2's (and under TP its
            # reduce-scatter's) is read by the residual add alone. A MoE block compiles in parts.
            kept -= (1 - moe_share) * (dim + reduce_scatters / 2)
        return kept
    if w.compiled:
        # What AOTAutograd's min-cut partitioner saves (measured through it on this CPU,
        # tests/unit/test_unit_memory_estimate.py): the block's input and both norms' outputs; q and
        # K/V as attention reads them (repeated to every query head) and attention's output with
        # wo's contiguous copy of it; w1's and w3's outputs and the SwiGLU product w2 reads. The
        # norms' and rotary's pointwise work is what it recomputes.
        heads = m.n_heads * m.head_dim
        return (3 * dim + 5 * heads + 3 * ffn) / tp
    # Each RMSNorm keeps its input and, on a CPU (where it is composed of pointwise ops rather than
    # one fused kernel), its normalized input too; its output is what the next matmuls read, gathered
    # under TP, except a MoE layer's: its router and experts read the rank's sequence slice.
    norm_kept = 2 if w.device == "cpu" else 1
    attention_whole, attention = m.attention_kept_per_token(norm_kept, w.device == "cpu", w.seq_len)
    whole = dim + (1 - moe_share) * dim + attention_whole
    sharded = 2 * norm_kept * dim + moe_share * dim + attention + ffn_kept(m) + routed_rows(w)
    return whole + sharded / tp


def _kept_per_layer(w: Workload) -> float:
    """Elements per token a layer keeps between its forward and its backward, averaged over layers
    (selective every-N checkpoints one block in N)."""
    ac = w.ac
    if ac.mode == "none":
        kept = layer_activations(w, "none")
    elif ac.mode == "full":
        kept = layer_activations(w, "full")
    elif ac.selective_ac_option == "op":
        kept = layer_activations(w, "op")
    else:
        every = int(ac.selective_ac_option)
        kept = (layer_activations(w, "full") + (every - 1) * layer_activations(w, "none")) / every
    p = w.parallelism
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    if cp > 1 and resolved_context_parallel_impl(p.context_parallel_impl, w.device) == "allgather":
        # The other cp ranks' K and V, per token of this rank, where a layer keeps attention's
        # inputs (checkpointed layers gather them again; torch's ring attention passes them on).
        keeping = {"none": 1.0, "full": 0.0}.get(ac.mode, 0.0 if ac.selective_ac_option == "op" else None)
        if keeping is None:
            keeping = 1 - 1 / int(ac.selective_ac_option)
        kept += keeping * gathered_kv(w.model, 1, w.seq_len, cp) / (w.seq_len / cp) / tp
    return kept


def _logit_bytes(w: Workload) -> int:
    """Bytes per logit at the loss's backward: eager, the float32 copy, its log-softmax and the
    gradient; compiled, the logits and their gradient in the param dtype (one fused kernel computes
    the log-sum-exp without a float32 copy), and under TP the float32 log-softmax of the shards that
    the compiled loss_parallel saves (what it saved on this CPU: 4 B a logit, where the unsharded
    compiled loss saves the logits and a row's statistics)."""
    if w.compiled_loss:
        return 2 * DTYPE_BYTES[w.param_dtype] + (4 if w.parallelism.tensor_parallel_degree > 1 else 0)
    # Under TP, loss_parallel's log-softmax (torch's tensor/parallel/loss.py) keeps the shifted
    # logits and their exponentials beside the float32 copy and the result: four float32 copies.
    return _LOGITS_BYTES + (4 if w.parallelism.tensor_parallel_degree > 1 else 0)


@dataclass(frozen=True)
class _Buffers:
    """Per-rank sizes (bytes) the phases are summed from."""

    states: tuple[int, int]  # (fp32 sharded parameters, AdamW state)
    sharded_grads: int
    kept: float  # one microbatch through one layer
    layer_transient: float  # a layer's backward: its recomputation and gradient temporaries
    logits: float
    head_activations: float


def _buffers(w: Workload, rank: PipelineRank) -> _Buffers:
    m, p = w.model, w.parallelism
    tp, shards = p.tensor_parallel_degree, max(1, w.fsdp_shards)
    local = rank.parameters(m) / (tp * shards)
    act = DTYPE_BYTES[w.param_dtype]
    tokens = w.tokens
    recompute = 0.0 if w.ac.mode == "none" else layer_activations(w, "none")
    # Gradients of a layer's activations during its backward: an eager layer's kept tensors in size,
    # of which about half are alive at once (each op's saved inputs are freed as its backward runs,
    # while the gradients of earlier ones appear); compiled, fused backward kernels write half that.
    grads = layer_activations(dataclasses.replace(w, compiled=False), "none") * (0.25 if w.compiled else 0.5)
    float8_casts = (layer_parameters(m) / tp + tokens * m.active_ffn_hidden_dim / tp) if w.float8 else 0
    return _Buffers(
        states=(int(local * _PARAM_BYTES), int(local * _ADAM_BYTES)),
        sharded_grads=int(local * _GRAD_BYTES),
        kept=_kept_per_layer(w) * tokens * act,
        layer_transient=(recompute + grads) * tokens * act + float8_casts,
        logits=tokens * m.vocab_size / tp * _logit_bytes(w) if rank.last else 0.0,
        # The final norm's input and output, read by the output matmul (gathered under TP).
        head_activations=2 * m.dim * tokens * act if rank.last else 0.0,
    )


def _fsdp_units(w: Workload, rank: PipelineRank) -> tuple[float, float]:
    """(bytes of one block's gathered weights, of the head's: norm and output), in what FSDP
    all-gathers: the param dtype, float8 for the linears' weights under float8 all-gather."""
    m, tp = w.model, w.parallelism.tensor_parallel_degree
    gathered = 1 if w.float8_all_gather else DTYPE_BYTES[w.param_dtype]
    head = (m.vocab_size * m.dim * DTYPE_BYTES[w.param_dtype] / tp) if rank.last else 0.0
    return sum(unit_parameters(w)) * gathered, head


def _pipeline_steady_state(
    w: Workload, rank: PipelineRank, pp_rank: int, b: _Buffers, common: dict, buckets: float
) -> RankMemory:
    """A pipeline rank's peak: its steady state, with the schedule's microbatches in flight."""
    p, fsdp = w.parallelism, w.fsdp_shards > 1
    microbatches = w.local_batch_size // w.microbatch
    chunks = pipeline_chunks_in_flight(p, microbatches, pp_rank)
    held = gathered_parameters(w, rank)
    # A step that returns its outputs keeps every microbatch's, the logits in the param dtype, on the
    # last stage until the schedule merges them at its end (PipelineStage.output_chunks).
    returns = rank.last and w.pipeline_returns_outputs
    returned = microbatches * w.tokens * w.model.vocab_size / p.tensor_parallel_degree if returns else 0.0
    return RankMemory(
        **common,
        # Accumulated unsharded in the reduce dtype under FSDP (sharded ones come at the end).
        gradients=int(held * DTYPE_BYTES[w.reduce_dtype] if fsdp else b.sharded_grads),
        activations=int(b.kept * rank.layers / rank.stages * chunks + b.head_activations),
        logits=int(b.logits + returned * DTYPE_BYTES[w.param_dtype]),
        temporaries=int(b.layer_transient),
        communication=int(held * (1 if w.float8_all_gather else DTYPE_BYTES[w.param_dtype]) if fsdp else buckets),
        # The last microbatch's sharded gradients, in the reduce-scatter stream's own pool.
        allocator=b.sharded_grads if fsdp else 0,
        process=0,
        phase="pipeline steady state",
    )


def _rank_peak(w: Workload, rank: PipelineRank, pp_rank: int) -> RankMemory:
    """The larger of a rank's two moments (see the module's docstring)."""
    m, p = w.model, w.parallelism
    b = _buffers(w, rank)
    fsdp = w.fsdp_shards > 1
    layer_unit, head_unit = _fsdp_units(w, rank) if fsdp else (0.0, 0.0)
    reduce_bytes = DTYPE_BYTES[w.reduce_dtype]
    tp = p.tensor_parallel_degree
    # A unit's unsharded gradient (param dtype) and its reduce-scatter input (reduce dtype).
    unreduced = sum(unit_parameters(w)) * (DTYPE_BYTES[w.param_dtype] + reduce_bytes) if fsdp else 0.0
    # DDP's gradient buckets: a flat copy of the gradients, allocated once and kept (its Reducer).
    buckets = rank.parameters(m) / tp * reduce_bytes if not fsdp and p.data_parallel_replicate_degree > 1 else 0.0
    common = {"parameters": b.states[0], "optimizer_state": b.states[1], "buffers": rope_table_bytes(m) * rank.stages}

    if p.pipeline_parallel_degree > 1:
        return _pipeline_steady_state(w, rank, pp_rank, b, common, buckets)

    kept_all = b.kept * rank.layers + b.head_activations
    reshard = p.fsdp_reshard_after_forward
    gathered_after_forward = {"never": rank.layers, "always": 0}.get(reshard, 1) * layer_unit + head_unit
    # What earlier microbatches leave: sharded gradients where each one reduces them; under
    # training.gradient_sync=last_microbatch, FSDP's every unit's unsharded gradient, upcast to the
    # reduce dtype (torch's FSDPParam.to_accumulated_grad_if_needed), on the compute stream.
    accumulated = fsdp and w.accumulation > 1 and w.gradient_reductions == 1
    unsharded_grads = gathered_parameters(w, rank) * reduce_bytes if accumulated else 0.0
    sharded_before_loss = b.sharded_grads if w.accumulation > 1 and not accumulated else 0
    loss_backward = RankMemory(
        **common,
        gradients=int(unsharded_grads) or sharded_before_loss,
        activations=int(kept_all),
        logits=int(b.logits),
        temporaries=0,
        communication=int(gathered_after_forward + buckets),
        allocator=0,
        process=0,
        phase="loss backward",
    )
    end_of_backward = RankMemory(
        **common,
        # Accumulating, the first layer's unit still holds its unsharded gradient.
        gradients=b.sharded_grads + int(sum(unit_parameters(w)) * reduce_bytes if accumulated else 0),
        activations=int(b.kept),
        logits=0,
        temporaries=int(b.layer_transient),
        # The running and the prefetched unit, and the running one's unreduced gradient.
        communication=int(2 * layer_unit + unreduced + buckets),
        allocator=0,
        process=0,
        phase="end of backward",
    )
    peak = max(loss_backward, end_of_backward, key=lambda r: r.total)
    if not fsdp:
        return peak
    moments = ((loss_backward, sharded_before_loss), (end_of_backward, b.sharded_grads))
    reserved = _reserved_by_stream(moments, b.sharded_grads, (layer_unit, head_unit))
    return dataclasses.replace(peak, allocator=int(max(0.0, reserved - peak.total)))


def _reserved_by_stream(moments: tuple[tuple[RankMemory, int], ...], sharded_grads: int, units: tuple) -> float:
    """An FSDP rank's reserved bytes, each stream's pool at its own high-water mark (the module's
    docstring); `moments`: each with the sharded gradients it holds (the reduce-scatter stream's);
    `units`: a block's and the head's gathered bytes."""
    layer_unit, head_unit = units
    compute_stream = max(moment.total - held for moment, held in moments)
    return compute_stream + sharded_grads + max(2 * layer_unit, layer_unit + head_unit)


def rank_memory(w: Workload, pp_rank: int | None = None) -> RankMemory:
    """The busiest rank's peak, active and reserved (degrees resolved); or pipeline rank `pp_rank`'s."""
    ranks = pipeline_ranks(w.parallelism, w.model.n_layers)
    chosen = ranks if pp_rank is None else {pp_rank: ranks[pp_rank]}
    return max((_reserved(w, _rank_peak(w, rank, index)) for index, rank in chosen.items()), key=lambda r: r.total)


def _reserved(w: Workload, peak: RankMemory) -> RankMemory:
    """`peak` with what the device's allocator and the process keep beyond its tensors."""
    fitted = peak.active * w.allocator_slack  # the profile's, where a calibration found fragmentation
    if w.device == "cpu":
        return dataclasses.replace(
            peak, allocator=int(peak.active * _CPU_ALLOCATOR_SLACK + fitted), process=CPU_RANK_BASELINE_BYTES
        )
    tp = w.parallelism.tensor_parallel_degree
    largest_transient = max(
        w.tokens * w.model.vocab_size / tp * (DTYPE_BYTES[w.param_dtype] if w.compiled_loss else 4)
        if peak.logits
        else 0.0,
        sum(unit_parameters(w)) * DTYPE_BYTES[w.param_dtype],
    )
    return dataclasses.replace(peak, allocator=int(peak.allocator + largest_transient + fitted))

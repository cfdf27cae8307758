"""What a training step asks of each rank, as the estimates read it (torch-free): the model's shape,
the resolved layout, the step's shapes and dtypes, the options that change its kernels (compile,
float8, async TP) and the device kind; and which parts of the model a rank holds (its pipeline
stages, as the trainer cuts them: parallel/stages.py) and how many stage-microbatches in flight."""

import functools
import math
from dataclasses import dataclass

from titan_exp.estimate.documents import flex_causal_keys
from titan_exp.models.config import ModelConfig
from titan_exp.parallel.config import (
    SINGLE_STAGE_SCHEDULES,
    V_SHAPED_SCHEDULES,
    ActivationCheckpointConfig,
    ParallelismConfig,
)
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.stages import StagePlan

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


@dataclass(frozen=True)
class Workload:
    """What a step asks of each rank: the model, the resolved layout, the step's shapes and dtypes,
    and the device kind (cuda or cpu: attention kernels and allocators differ)."""

    model: ModelConfig
    parallelism: ParallelismConfig
    ac: ActivationCheckpointConfig
    local_batch_size: int
    seq_len: int
    accumulation: int = 1
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    # The linears' low-precision recipe: none, tensorwise or rowwise (float8), mxfp8.
    quantize: str = "none"
    float8_all_gather: bool = False
    compiled: bool = False  # the blocks
    loss_compiled: bool = False
    async_tp: bool = False
    device: str = "cuda"
    # plan.expert_load_imbalance, as set (`busiest_rank_rows` is what the model reads).
    expert_load_imbalance: float = 1.0
    # What the allocator reserves beyond the memory model's count, a share of the live tensors
    # (the device profile's hardware.allocator_slack).
    allocator_slack: float = 0.0
    # Under a document mask, the mean keys FlexAttention computes a query (estimate/documents.py's
    # flex_keys); None: causal over the window.
    masked_keys: float | None = None
    # AdamW's kernels (optimizer.implementation): foreach, fused or for-loop.
    optimizer: str = "foreach"
    # The pipeline step returns the last stage's outputs (plan.pipeline_returns_outputs).
    pipeline_returns_outputs: bool = False
    # training.gradient_sync: data-parallel gradients reduced after every microbatch or the last.
    gradient_sync: str = "every_microbatch"

    @property
    def gradient_reductions(self) -> int:
        """How many times a step reduces its data-parallel gradients (per pipeline microbatch
        schedule, once: a pipeline reduces after its last microbatch whatever the setting)."""
        if self.gradient_sync == "last_microbatch" or self.parallelism.pipeline_parallel_degree > 1:
            return 1
        return self.accumulation

    @property
    def busiest_rank_rows(self) -> float:
        """The busiest expert-parallel rank's routed rows over the mean rank's: the setting under EP;
        1 without, where a rank runs exactly its own tokens' rows whatever the experts' loads."""
        return self.expert_load_imbalance if self.parallelism.expert_parallel_degree > 1 else 1.0

    @property
    def keys_per_query(self) -> float:
        """The keys attention's kernel computes per query: half the window, causal (its kernels skip
        the blocks above the diagonal; a family that runs FlexAttention on CUDA even without a
        document mask, as GPT-OSS, its whole diagonal blocks too); under a document mask,
        FlexAttention's blocks on CUDA (`masked_keys`) and the whole window on CPU ranks, whose
        SDPA takes the mask dense and computes every key."""
        cuda = self.device == "cuda"
        if self.masked_keys is None:
            flex = cuda and self.model.cuda_attention_kernel(document_mask=False) == "flex"
            keys = flex_causal_keys(self.seq_len) if flex else self.seq_len / 2
        else:
            keys = self.masked_keys if cuda else self.seq_len
        return self.model.keys_per_query(keys, self.seq_len, cuda)

    @property
    def float8(self) -> bool:
        return self.quantize != "none"

    @property
    def compiled_loss(self) -> bool:
        """The loss compiled (train/loss.py: not under pipelining)."""
        return self.loss_compiled and self.parallelism.pipeline_parallel_degree == 1

    @property
    def microbatch(self) -> int:
        """Samples per forward: a pipeline microbatch, else the local batch."""
        p = self.parallelism
        return p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else self.local_batch_size

    @property
    def tokens(self) -> float:
        """Tokens of one microbatch on one rank (context parallelism splits the sequence)."""
        return self.microbatch * self.seq_len / self.parallelism.context_parallel_degree

    @functools.cached_property  # resolving the degrees is not free, and the estimates ask often
    def experts_tp(self) -> int:
        """The tp ranks each expert's hidden dim is split over (ParallelDims.experts_tp)."""
        p = self.parallelism
        return ParallelDims.resolve(p, math.prod(p.degrees().values())).experts_tp

    @property
    def fsdp_shards(self) -> int:
        p = self.parallelism
        return p.data_parallel_shard_degree * p.context_parallel_degree


def block_parameters(m: ModelConfig, layer: int) -> int:
    """Transformer block `layer`'s: its family's attention, its feed-forward (a SwiGLU, or a MoE
    layer's router, experts and shared experts), two norms."""
    attention = m.attention_parameters()
    if m.is_moe_layer(layer):
        moe = m.moe
        shared = 3 * m.dim * moe.num_shared_experts * moe.hidden_dim
        ffn = moe.router_parameters(m.dim) + moe.num_experts * moe.expert_parameters(m.dim) + shared
    else:
        ffn = 3 * m.dim * m.ffn_hidden_dim
    return attention + ffn + 2 * m.dim


def _blocks_parameters(m: ModelConfig) -> int:
    """Every block's: a block's count depends only on its kind (dense or MoE), so one of each kind
    is counted (the planner asks this thousands of times a fit)."""
    counts: dict[bool, list[int]] = {}
    for layer in range(m.n_layers):
        counts.setdefault(m.is_moe_layer(layer), [layer, 0])[1] += 1
    return sum(n * block_parameters(m, layer) for layer, n in counts.values())


def layer_parameters(m: ModelConfig) -> int:
    """One block's (their mean where dense and MoE blocks mix: the estimates take every layer alike)."""
    return _blocks_parameters(m) // m.n_layers


def model_parameters(m: ModelConfig) -> int:
    """Every parameter of the model (a tied output counted once)."""
    outside_layers = m.vocab_size * m.dim * (1 if m.tie_word_embeddings else 2) + m.dim
    return _blocks_parameters(m) + outside_layers


def routed_expert_parameters(m: ModelConfig) -> float:
    """One layer's routed experts (their mean over the layers, as layer_parameters)."""
    if not m.moe.enabled:
        return 0.0
    return m.num_moe_layers * m.moe.num_experts * m.moe.expert_parameters(m.dim) / m.n_layers


def unit_parameters(w: Workload) -> tuple[float, float]:
    """(dense, experts): one layer's parameters as its FSDP unit gathers them on a rank. TP splits
    the dense ones; expert parallelism leaves a rank num_experts / ep experts (gathered over the
    data-parallel ranks EP leaves, not over all of FSDP's), TP their hidden dim where it splits them."""
    m, p = w.model, w.parallelism
    experts = routed_expert_parameters(m)
    dense = (layer_parameters(m) - experts) / p.tensor_parallel_degree
    return dense, experts / (p.expert_parallel_degree * w.experts_tp)


def whole_under_tensor_parallel(m: ModelConfig, seq_len: int) -> float:
    """The share of a layer's matmul work (multiply-adds per token, attention's scores included,
    averaged over the layers) that every tp rank runs whole: the weights TP leaves whole (latent
    attention's down-projections), over the gathered sequence. 0 where TP splits every matmul."""
    whole = m.whole_under_tensor_parallel_parameters()
    if not whole:
        return 0.0
    active = layer_parameters(m) - inactive_parameters(m) / m.n_layers
    scores = seq_len / 2 * m.n_heads * 2 * m.attention_flops_dim  # q·k and the values; causal: half the keys
    return whole / (active + scores)


def inactive_parameters(m: ModelConfig) -> int:
    """The parameters a token does not go through: the experts its router did not pick."""
    if not m.moe.enabled:
        return 0
    return m.num_moe_layers * (m.moe.num_experts - m.moe.top_k) * m.moe.expert_parameters(m.dim)


@dataclass(frozen=True)
class PipelineRank:
    """What one pipeline rank holds: its layers, whether its stages include the first (embeddings)
    and the last (norm, output, loss), and its stages' count."""

    layers: int
    first: bool
    last: bool
    stages: int

    def parameters(self, m: ModelConfig) -> int:
        return self.layers * layer_parameters(m) + self.outside_layers(m)

    def outside_layers(self, m: ModelConfig) -> int:
        """The embeddings, the final norm and the output projection its stages hold (a tied output
        is the embedding, counted once)."""
        embedding = m.vocab_size * m.dim if self.first else 0
        shares_embedding = m.tie_word_embeddings and self.first
        head = m.dim + (0 if shares_embedding else m.vocab_size * m.dim) if self.last else 0
        return embedding + head


def pipeline_ranks(p: ParallelismConfig, n_layers: int) -> dict[int, PipelineRank]:
    """Every pipeline rank's parts, as the trainer cuts stages (uneven stages can make a middle
    rank the busiest)."""
    pp = p.pipeline_parallel_degree
    plan = StagePlan.from_config(p, n_layers)
    ranks = {}
    for rank in range(pp):
        stages = plan.stage_ids(rank, pp, p.pipeline_parallel_schedule)
        layers = sum(len(plan.layers(s, n_layers)) for s in stages)
        ranks[rank] = PipelineRank(layers, 0 in stages, plan.num_stages - 1 in stages, len(stages))
    return ranks


def pipeline_chunks_in_flight(p: ParallelismConfig, microbatches: int, pp_rank: int = 0) -> int:
    """Stage-microbatches whose activations pipeline rank `pp_rank` holds at its peak, as torch's
    schedules order their work: every microbatch under GPipe and, per stage, under LoopedBFS; one
    per rank from it to the last under 1F1B; under the interleaved schedules (v stages per rank)
    their warm-up, (v-1)·pp + 2·(pp-1-rank) forwards, and the first steady one; under the V-shaped
    ones, 2·(pp-rank)."""
    pp, schedule = p.pipeline_parallel_degree, p.pipeline_parallel_schedule
    if pp == 1:
        return 1
    if schedule == "GPipe":
        return microbatches
    if schedule in SINGLE_STAGE_SCHEDULES:
        return min(pp - pp_rank, microbatches)
    v = 2
    if schedule == "LoopedBFS":
        return microbatches * v
    if schedule in V_SHAPED_SCHEDULES:
        return min(microbatches * v, 2 * (pp - pp_rank))
    return min(microbatches * v, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)


def gathered_parameters(w: Workload, rank: PipelineRank) -> float:
    """What a pipeline rank's stages hold gathered between its microbatches (FSDP unsharded, the
    unit of one layer as `unit_parameters` gathers it: TP splits the dense weights, EP leaves the
    rank its own experts), with the embeddings and head it holds, split over tp."""
    return rank.layers * sum(unit_parameters(w)) + rank.outside_layers(w.model) / w.parallelism.tensor_parallel_degree


def part_parameters(m: ModelConfig, p: ParallelismConfig) -> int:
    """Parameters of the busiest pipeline rank's parts before sharding (the whole model without a
    pipeline)."""
    return max(rank.parameters(m) for rank in pipeline_ranks(p, m.n_layers).values())


def local_parameters(w: Workload) -> float:
    """Parameters one rank holds after sharding (the busiest pipeline rank's)."""
    return part_parameters(w.model, w.parallelism) / (w.parallelism.tensor_parallel_degree * max(1, w.fsdp_shards))

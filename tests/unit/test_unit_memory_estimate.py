"""titan_exp/estimate/memory.py: parameter counts against published and hand-derived figures, and how
one rank's estimated peak (active and reserved) changes with sharding, tensor/pipeline/context
parallelism, activation checkpointing, compile, the dtypes and the device."""

import dataclasses

import pytest
import torch
from layouts import layout
from omegaconf import OmegaConf

from titan_exp.estimate.memory import (
    CPU_RANK_BASELINE_BYTES,
    GIB,
    RankMemory,
    layer_activations,
    rank_memory,
)
from titan_exp.estimate.workload import (
    Workload,
    inactive_parameters,
    layer_parameters,
    model_parameters,
    part_parameters,
    pipeline_chunks_in_flight,
    pipeline_ranks,
    routed_expert_parameters,
    whole_under_tensor_parallel,
)
from titan_exp.models.common.moe.config import MoEConfig
from titan_exp.models.config import ModelConfig
from titan_exp.models.registry import build_model
from titan_exp.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_exp.parallel.config import ActivationCheckpointConfig, ParallelismConfig
from titan_exp.parallel.stages import StagePlan

from conftest import compose_config

# The debug model (ModelConfig's defaults, titan_exp/conf/model/llama3_debug.yaml): dim 256, 6 layers, 16 heads
# of 16, 4 kv heads, vocab 2048, ffn hidden round_up_256(int(8/3·256) = 682) = 768.
DEBUG = ModelConfig()
# Per layer: wq + wo 2·256·256 = 131,072; wk + wv 2·256·(4·16) = 32,768; w1, w2, w3 3·256·768 = 589,824;
# two norms 2·256 = 512.
DEBUG_LAYER = 131_072 + 32_768 + 589_824 + 512  # 754,176
DEBUG_EMBEDDING = 2048 * 256  # 524,288
# Six layers, the embedding and the output (untied), the final norm.
DEBUG_PARAMS = 6 * DEBUG_LAYER + 2 * DEBUG_EMBEDDING + 256  # 5,573,888

NO_AC = ActivationCheckpointConfig(mode="none")


def memory(p: ParallelismConfig, *, m: ModelConfig = DEBUG, batch: int = 4, seq_len: int = 256, **kw) -> RankMemory:
    """One rank's peak on a GPU (no CPU process baseline), fp32, no checkpointing unless given."""
    return rank_memory(Workload(m, p, kw.pop("ac", NO_AC), batch, seq_len, **kw))


@pytest.fixture(scope="module")
def llama3_8b() -> ModelConfig:
    return OmegaConf.to_object(compose_config(["model=llama3_8b"])).model


def test_llama3_8b_has_its_published_parameter_count(llama3_8b: ModelConfig) -> None:
    """titan_exp/conf/model/llama3_8b.yaml: 8,030,261,248 parameters. By hand: ffn hidden
    round_up_1024(int(1.3·int(8/3·4096) = 1.3·10922)) = 14,336; a layer 2·4096² (wq, wo) +
    2·4096·1024 (wk, wv) + 3·4096·14,336 + 2·4096 = 218,112,000; 32 of them, 2·128,256·4096
    (embedding, output) and 4096 (norm)."""
    assert llama3_8b.ffn_hidden_dim == 14_336
    assert layer_parameters(llama3_8b) == 218_112_000
    assert model_parameters(llama3_8b) == 32 * 218_112_000 + 2 * 128_256 * 4096 + 4096 == 8_030_261_248


@pytest.mark.parametrize(
    "flavor,count",
    [("llama3_1b", 1_235_814_400), ("llama3_70b", 70_553_706_496), ("llama3_405b", 405_853_388_800)],
)
def test_other_flavors_have_their_published_parameter_counts(flavor: str, count: int) -> None:
    """The analytic count (no torch) agrees with Meta's published sizes (the 1B one has tied embeddings)."""
    assert model_parameters(OmegaConf.to_object(compose_config([f"model={flavor}"])).model) == count


def test_debug_model_counts_by_hand() -> None:
    assert layer_parameters(DEBUG) == DEBUG_LAYER
    assert model_parameters(DEBUG) == DEBUG_PARAMS == 5_573_888


@pytest.mark.parametrize("tied", [False, True])
def test_analytic_count_matches_the_torch_model(tied: bool) -> None:
    """model_parameters agrees with the Transformer itself (built on meta), tied or not."""
    m = dataclasses.replace(DEBUG, tie_word_embeddings=tied)
    with torch.device("meta"):
        assert model_parameters(m) == build_model(m).num_params()


def test_tied_embeddings_are_counted_once() -> None:
    tied = dataclasses.replace(DEBUG, tie_word_embeddings=True)
    assert model_parameters(DEBUG) - model_parameters(tied) == DEBUG_EMBEDDING


def test_part_parameters_is_the_whole_model_without_a_pipeline_else_the_busiest_stage() -> None:
    """pp 2 (1F1B) over 6 layers: rank 0 holds 3 layers and the embedding, rank 1 three layers, the
    final norm and the output (the busier by `dim`)."""
    assert part_parameters(DEBUG, layout()) == DEBUG_PARAMS
    assert part_parameters(DEBUG, layout(pp=2)) == 3 * DEBUG_LAYER + DEBUG_EMBEDDING + 256


@pytest.mark.parametrize("pp", [2, 3, 6])
def test_pipeline_stages_hold_fewer_parameters(pp: int) -> None:
    """1F1B over 6 layers: each rank 6/pp layers; the first adds the embedding, the last the final
    norm and the output (fp32 master weights, 4 bytes each)."""
    w = Workload(DEBUG, layout(pp=pp), NO_AC, pp, 256)
    first, last = rank_memory(w, pp_rank=0), rank_memory(w, pp_rank=pp - 1)
    assert first.parameters == 4 * (6 // pp * DEBUG_LAYER + DEBUG_EMBEDDING)
    assert last.parameters == 4 * (6 // pp * DEBUG_LAYER + DEBUG_EMBEDDING + 256)
    assert rank_memory(w).parameters < memory(layout()).parameters


def test_single_rank_holds_fp32_weights_and_two_adam_moments_and_gradients_at_the_end() -> None:
    """4 + 8 bytes per parameter always; the 4 bytes of gradients where the peak is the end of
    backward (they do not exist at the loss's backward without accumulation)."""
    single = memory(layout())
    assert single.parameters == 4 * DEBUG_PARAMS and single.optimizer_state == 8 * DEBUG_PARAMS
    assert single.gradients == (4 * DEBUG_PARAMS if single.phase == "end of backward" else 0)
    assert single.communication == 0 and single.process == 0


def test_activations_and_logits_by_hand_at_the_loss_backward() -> None:
    """Batch 8 × 1024 tokens, fp32, no checkpointing, on a GPU: each of 6 layers keeps 2·dim +
    7·dim + 4·ffn = 2·256 + 1,792 + 3,072 = 5,376 elements per token, the head 2·dim; the logits
    12 bytes each (float32 copy, log-softmax, gradient)."""
    big = memory(layout(), batch=8, seq_len=1024)
    tokens = 8 * 1024
    assert big.phase == "loss backward"
    assert big.activations == 6 * tokens * 5_376 * 4 + 2 * 256 * tokens * 4
    assert big.logits == tokens * 2048 * 12


@pytest.mark.parametrize("shard", [2, 4, 8])
def test_fsdp_divides_parameters_and_optimizer_state(shard: int) -> None:
    one, sharded = memory(layout()), memory(layout(dp_shard=shard))
    for name in ("parameters", "optimizer_state"):
        assert getattr(sharded, name) == pytest.approx(getattr(one, name) / shard, abs=1), name
    assert sharded.activations == one.activations and sharded.communication > 0
    # At the end of backward (states dominate a tiny batch) the gradients are sharded too; FSDP
    # holds the running and the prefetched unit gathered (2 · 4 bytes a parameter of a block), the
    # running unit's unsharded gradient and its reduce-scatter input (4 + 4): 16 bytes, any shard.
    end_one, end_sharded = memory(layout(), batch=1, seq_len=16), memory(layout(dp_shard=shard), batch=1, seq_len=16)
    assert end_one.phase == end_sharded.phase == "end of backward"
    assert end_sharded.gradients == pytest.approx(end_one.gradients / shard, abs=1)
    assert end_sharded.communication == 16 * DEBUG_LAYER


@pytest.mark.parametrize("reshard,gathered_layers", [("always", 0), ("default", 1), ("never", 6)])
def test_fsdp_buffers_by_hand_at_the_loss_backward(reshard: str, gathered_layers: int) -> None:
    """fp32, dp_shard 2, batch 4 × 256: at the loss's backward the head's output weight stays
    gathered (2048·256·4 bytes), and the blocks FSDP left gathered after forward: none when it
    always reshards, the last one by default (torchtitan's), all six when it never does."""
    p = dataclasses.replace(layout(dp_shard=2), fsdp_reshard_after_forward=reshard)
    loss = memory(p)
    assert loss.phase == "loss backward"
    assert loss.communication == gathered_layers * DEBUG_LAYER * 4 + DEBUG_EMBEDDING * 4


def test_context_parallel_ranks_shard_like_fsdp_ranks() -> None:
    """dp_shard·cp is FSDP's shard group: dp_shard 2 × cp 2 shards the states four ways."""
    both = memory(layout(dp_shard=2, cp=2))
    assert both.parameters == pytest.approx(memory(layout(dp_shard=4)).parameters, abs=1)


def test_replicas_do_not_shard_and_ddp_keeps_gradient_buckets() -> None:
    one, ddp = memory(layout()), memory(layout(dp_replicate=4))
    assert ddp.parameters == one.parameters
    end = memory(layout(dp_replicate=4), batch=1, seq_len=16)  # states dominate: the end of backward
    assert end.phase == "end of backward" and end.communication == 4 * DEBUG_PARAMS


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_divides_states_and_logits(tp: int) -> None:
    one, split = memory(layout()), memory(layout(tp=tp))
    assert split.parameters == pytest.approx(one.parameters / tp, abs=1)
    assert split.activations < one.activations
    # loss_parallel keeps four float32 copies of its vocabulary shard (16 bytes a logit, not 12).
    if split.phase == one.phase == "loss backward":
        assert split.logits == pytest.approx(one.logits / tp * 16 / 12, abs=1)


def test_activation_checkpointing_full_keeps_less_than_selective_less_than_none() -> None:
    kept = {
        mode: memory(layout(), ac=ActivationCheckpointConfig(mode=mode), batch=8, seq_len=1024).activations
        for mode in ("full", "selective", "none")
    }
    assert kept["full"] < kept["selective"] < kept["none"]
    tp2 = Workload(DEBUG, layout(tp=2), NO_AC, 4, 256)  # per layer, under TP too
    assert layer_activations(tp2, "full") < layer_activations(tp2, "op") < layer_activations(tp2, "none")
    # Full, 32 layers (the loss's backward is the peak): the block's input (dim) per token and
    # layer, and the head's two dim-wide tensors.
    deep = dataclasses.replace(DEBUG, n_layers=32)
    full = memory(layout(), m=deep, ac=ActivationCheckpointConfig(mode="full"), batch=8, seq_len=1024)
    assert full.phase == "loss backward"
    assert full.activations == 32 * 8 * 1024 * 256 * 4 + 2 * 256 * 8 * 1024 * 4


@pytest.mark.parametrize(
    "ac,compiled,per_token",
    [
        # 2·dim (norms' outputs) + 7·dim + 4·ffn
        (NO_AC, False, 2 * 256 + 7 * 256 + 4 * 768),  # 5,376
        # w2's whole output (dim); the block's input, wq's and attention's outputs (3·dim); wv's (kv
        # 4·16 = 64) and w1's (ffn)
        (ActivationCheckpointConfig("selective", "op"), False, 256 + 3 * 256 + 64 + 768),  # 1,856
        # every 2nd block keeps only its input: (dim + 5,376) / 2
        (ActivationCheckpointConfig("selective", "2"), False, (256 + 5_376) // 2),  # 2,816
        # compiled: the block's input and the norms' outputs, q and K/V repeated to every head,
        # attention's output and wo's copy of it, w1's and w3's outputs and w2's input (3·ffn)
        (NO_AC, True, 3 * 256 + 5 * 256 + 3 * 768),  # 4,352
        # compiled op: as eager op without w2's output, which no backward reads
        (ActivationCheckpointConfig("selective", "op"), True, 3 * 256 + 64 + 768),  # 1,600
    ],
    ids=["none", "op", "every_2", "compiled", "compiled_op"],
)
def test_kept_activations_per_layer_by_hand(ac: ActivationCheckpointConfig, compiled: bool, per_token: int) -> None:
    """Batch 8 × 1024 tokens, fp32, at the loss's backward: 6 layers × `per_token` elements a token,
    and the head's two dim-wide tensors."""
    kept = memory(layout(), ac=ac, compiled=compiled, batch=8, seq_len=1024)
    assert kept.phase == "loss backward"
    assert kept.activations == 6 * 8 * 1024 * per_token * 4 + 2 * 256 * 8 * 1024 * 4


def _kept_by_autograd(m: ModelConfig, seq_len: int, batch: int = 2, compiled: str | None = None) -> float:
    """Elements per token that a block of the real model saves for its backward, averaged over the
    blocks (DeepSeek-V3's first is dense), on a CPU in float32, eager (or compiled, with `compiled`
    the checkpointing, none or per-op SAC: what the compiled blocks save): every saved tensor's
    storage once, the block's input included, weights and buffers not."""
    torch.manual_seed(0)
    model = build_model(m)
    if compiled == "op":
        apply_activation_checkpointing(model.layers, ActivationCheckpointConfig("selective", "op"))
    if compiled is not None:
        for block in model.layers.values():
            block.compile(backend="aot_eager_decomp_partition", fullgraph=True)
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    outputs = []  # kept alive, so that no storage is freed and its address reused
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for block in model.layers.values():
            x = torch.randn(batch, seq_len, m.dim, requires_grad=True)
            outputs.append(block(x, model.freqs_cis[:seq_len]))
    return sum(kept.values()) / 4 / (batch * seq_len * m.n_layers)


@pytest.mark.parametrize(
    "name", ["llama3_debug", "qwen3_debug", "qwen3_moe_debug", "deepseek_v3_debug", "gpt_oss_debug"]
)
def test_kept_activations_per_token_are_what_autograd_saves_on_a_cpu(name: str) -> None:
    """The model's count per token of one eager block against the tensors torch's autograd keeps
    for that block's backward, on this CPU: Llama's attention, Qwen3's wider heads and q/k norms,
    a MoE layer's routed rows, router and indices, DeepSeek-V3's latent attention (SDPA's math
    path on a CPU, its probabilities growing with the sequence) and shared expert, and GPT-OSS's
    attention with sinks (every score's probability) and clamped experts."""
    m = OmegaConf.to_object(compose_config([f"model={name}"])).model
    for seq_len in (64, 256):
        w = Workload(m, layout(), NO_AC, 2, seq_len, device="cpu")
        assert layer_activations(w, "none") == pytest.approx(_kept_by_autograd(m, seq_len=seq_len), rel=0.02)


def test_compiled_selective_checkpointing_keeps_what_the_partitioner_saves_on_a_cpu() -> None:
    """Per-op SAC in a compiled block: the model's count per token against the tensors the compiled
    blocks save for backward, through AOTAutograd's min-cut partitioner (the one inductor runs;
    `aot_eager_decomp_partition` skips inductor's code generation): the SAC policy's saved outputs
    that a backward reads, not w2's (its log-sum-exp, one float a head, is the 1% left)."""
    m, seq_len = DEBUG, 256
    measured = _kept_by_autograd(m, seq_len, compiled="op")
    w = Workload(m, layout(), ActivationCheckpointConfig("selective", "op"), 2, seq_len, compiled=True)
    assert layer_activations(w, "op") == 3 * m.dim + m.kv_heads * m.head_dim + m.ffn_hidden_dim
    assert layer_activations(w, "op") == pytest.approx(measured, rel=0.02)
    assert measured < layer_activations(dataclasses.replace(w, compiled=False), "op")


def test_compiled_blocks_without_checkpointing_keep_what_the_partitioner_saves_on_a_cpu() -> None:
    """No AC, compiled: the model's count per token against what the min-cut partitioner saves (its
    log-sum-exp and the norms' reciprocal RMS, a float a head and two a token, are the 0.4% left):
    more than a guess of "matmul inputs only" (2,688 here) and less than eager."""
    m, seq_len = DEBUG, 256
    measured = _kept_by_autograd(m, seq_len, compiled="none")
    w = Workload(m, layout(), NO_AC, 2, seq_len, compiled=True)
    assert layer_activations(w, "none") == 3 * m.dim + 5 * m.n_heads * m.head_dim + 3 * m.ffn_hidden_dim
    assert layer_activations(w, "none") == pytest.approx(measured, rel=0.02)
    assert measured < _kept_by_autograd(m, seq_len)


def test_compile_keeps_less_without_checkpointing_and_a_compiled_loss_shrinks_the_logits() -> None:
    eager, compiled = memory(layout(), batch=8, seq_len=1024), memory(layout(), batch=8, seq_len=1024, compiled=True)
    assert compiled.activations < eager.activations
    loss = memory(layout(), batch=8, seq_len=1024, param_dtype="bfloat16", loss_compiled=True)
    assert loss.logits == 8 * 1024 * 2048 * 4  # the logits and their gradient in bfloat16


def test_bfloat16_halves_activations_not_fp32_states() -> None:
    fp32, bf16 = (
        memory(layout(), batch=8, seq_len=1024),
        memory(layout(), batch=8, seq_len=1024, param_dtype="bfloat16"),
    )
    assert bf16.activations * 2 == pytest.approx(fp32.activations, abs=2)
    assert (bf16.parameters, bf16.optimizer_state, bf16.logits) == (fp32.parameters, fp32.optimizer_state, fp32.logits)


def test_pipelined_fsdp_gradients_accumulate_unsharded_in_the_reduce_dtype() -> None:
    """Under FSDP + pipeline the stage's gradients stay whole until the last microbatch, upcast to
    the reduce dtype (float32 here), and its parameters stay gathered (param dtype)."""
    p = layout(dp_shard=2, pp=2)
    bf16 = rank_memory(Workload(DEBUG, p, NO_AC, 4, 256, param_dtype="bfloat16", reduce_dtype="float32"), pp_rank=0)
    held = 3 * DEBUG_LAYER + DEBUG_EMBEDDING  # the first rank's three layers and the embedding
    assert bf16.phase == "pipeline steady state"
    assert bf16.gradients == held * 4 and bf16.communication == held * 2
    assert bf16.parameters == pytest.approx(held * 4 / 2, abs=1)


def test_a_pipelined_expert_parallel_rank_holds_only_its_own_experts_gathered() -> None:
    """Under FSDP + pipeline + EP a stage stays gathered between microbatches, but EP leaves each
    rank num_experts / ep of a layer's experts: the gathered weights and their unsharded gradients
    are the rank's dense layers and its own experts, not every expert (DeepSeek-V3 671B on 512 H100s,
    PP 8 × EP 32, was planned at 528 GiB a rank where torchtitan logged 60)."""
    moe = OmegaConf.to_object(compose_config(["model=qwen3_moe_debug"])).model
    w = Workload(moe, layout(dp_shard=4, pp=2, ep=4), NO_AC, 4, 256, param_dtype="bfloat16", reduce_dtype="float32")
    rank = pipeline_ranks(w.parallelism, moe.n_layers)[0]
    experts = routed_expert_parameters(moe)
    own_experts = rank.layers * (layer_parameters(moe) - experts + experts / 4) + moe.vocab_size * moe.dim
    peak = rank_memory(w, pp_rank=0)
    assert (peak.communication, peak.gradients) == (int(own_experts * 2), int(own_experts * 4))


@pytest.mark.parametrize(
    "schedule,expected",
    # pp 4, 8 microbatches, rank 0 (v = 2 stages per rank for the multi-stage ones).
    [
        ("GPipe", 8),  # every microbatch
        ("1F1B", 4),  # one per rank from it to the last: min(pp, m)
        ("LoopedBFS", 16),  # every microbatch per stage: m·v
        ("ZBVZeroBubble", 8),  # min(m·v, 2·pp)
        ("DualPipeV", 8),
        ("Interleaved1F1B", 11),  # min(m·v, (v-1)·pp + 2·(pp-1) + 1 = 4 + 6 + 1)
        ("InterleavedZeroBubble", 11),
    ],
)
def test_pipeline_chunks_in_flight_per_schedule(schedule: str, expected: int) -> None:
    p = layout(pp=4, schedule=schedule)
    assert pipeline_chunks_in_flight(p, 8) == expected
    # The last rank keeps fewer under 1F1B (one) and the interleaved schedules.
    if schedule in ("1F1B", "Interleaved1F1B"):
        assert pipeline_chunks_in_flight(p, 8, pp_rank=3) < expected
    # Without a pipeline, one microbatch whatever the schedule.
    assert pipeline_chunks_in_flight(layout(schedule=schedule), 8) == 1


@pytest.mark.parametrize("microbatches", [4, 8, 16])
def test_interleaving_keeps_more_stage_microbatches_in_flight_than_1f1b(microbatches: int) -> None:
    """pp 4, rank 0: 1F1B min(pp, m) = 4; Interleaved1F1B min(2·m, (2-1)·4 + 2·3 + 1 = 11)."""
    one = pipeline_chunks_in_flight(layout(pp=4), microbatches)
    interleaved = pipeline_chunks_in_flight(layout(pp=4, schedule="Interleaved1F1B"), microbatches)
    assert (one, interleaved) == (4, min(2 * microbatches, 11))
    assert interleaved > one


def test_interleaving_keeps_at_least_1f1bs_activations() -> None:
    """The issue's report: Interleaved1F1B predicted below 1F1B. pp 4 over 16 layers, 8
    microbatches, rank 0: 1F1B keeps 4 microbatches through its 4 layers (16 layer-microbatches);
    interleaved, 11 chunks of one 2-layer stage (22)."""
    deep = dataclasses.replace(DEBUG, n_layers=16)
    w = {s: Workload(deep, layout(pp=4, schedule=s), NO_AC, 8, 256) for s in ("1F1B", "Interleaved1F1B")}
    one, interleaved = (rank_memory(w[s], pp_rank=0).activations for s in ("1F1B", "Interleaved1F1B"))
    assert interleaved == pytest.approx(one * 22 / 16, abs=2)
    assert rank_memory(w["Interleaved1F1B"]).activations >= rank_memory(w["1F1B"]).activations


def test_gpipe_keeps_every_microbatch_1f1b_one_per_stage() -> None:
    """pp 2, batch 8 of microbatch 1, rank 0: GPipe keeps 8 microbatches' activations, 1F1B 2."""
    gpipe = rank_memory(Workload(DEBUG, layout(pp=2, schedule="GPipe"), NO_AC, 8, 256), pp_rank=0)
    one_f_one_b = rank_memory(Workload(DEBUG, layout(pp=2, schedule="1F1B"), NO_AC, 8, 256), pp_rank=0)
    assert gpipe.activations == 4 * one_f_one_b.activations
    assert gpipe.parameters == one_f_one_b.parameters


def test_the_first_and_the_last_pipeline_rank_are_both_modelled() -> None:
    """pp 2 (1F1B): the last rank holds the logits (8 microbatches of 1 × 256 tokens: the loss's
    float32 copies one at a time, 256·2048·12 bytes), the first none; the estimate is the larger of
    the two. A step that returns its outputs (torch's default, not titan_exp's) keeps every
    microbatch's too, 8·256·2048·4."""
    w = Workload(DEBUG, layout(pp=2), NO_AC, 8, 256)
    first, last = rank_memory(w, pp_rank=0), rank_memory(w, pp_rank=1)
    assert last.logits == 256 * 2048 * 12 and first.logits == 0
    assert rank_memory(w).total == max(first.total, last.total)
    returning = dataclasses.replace(w, pipeline_returns_outputs=True)
    assert rank_memory(returning, pp_rank=1).logits == last.logits + 8 * 256 * 2048 * 4
    assert rank_memory(returning, pp_rank=0).logits == 0


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_shaped_schedules_put_the_logits_on_the_first_rank(schedule: str) -> None:
    """pp 2 over 8 layers: rank 0 holds stages 0 and 3 (the embedding and the head), rank 1 stages
    1 and 2."""
    w = Workload(dataclasses.replace(DEBUG, n_layers=8), layout(pp=2, schedule=schedule), NO_AC, 8, 256)
    assert rank_memory(w, pp_rank=0).logits > 0 and rank_memory(w, pp_rank=1).logits == 0


def test_context_parallel_keeps_gathered_kv_only_where_layers_keep_attention_inputs() -> None:
    """All-gather CP without checkpointing keeps the other ranks' K and V per layer; full AC
    gathers them again in backward; torch's ring attention passes them on."""
    base = dict(batch=1, seq_len=4096)
    allgather = layout(cp=4, cp_impl="allgather")
    none = memory(allgather, **base).activations
    assert none > memory(layout(cp=4, cp_impl="torch"), **base).activations
    full = ActivationCheckpointConfig(mode="full")
    assert (
        memory(allgather, ac=full, **base).activations
        == memory(layout(cp=4, cp_impl="torch"), ac=full, **base).activations
    )


def test_reserved_is_above_active_on_a_gpu_and_on_a_cpu() -> None:
    """CUDA: the allocator's largest transient block (and FSDP's stream caches); CPU: glibc's ~10% and
    the process's own 0.4 GiB."""
    gpu, cpu = memory(layout(dp_shard=2)), memory(layout(dp_shard=2), device="cpu")
    assert gpu.reserved > gpu.active and gpu.allocator > 0 and gpu.process == 0
    assert cpu.process == CPU_RANK_BASELINE_BYTES and cpu.allocator == int(cpu.active * 0.1)


def test_a_gpus_allocator_keeps_its_largest_transient_block() -> None:
    """One GPU, fp32, no FSDP: at the loss's backward (batch 4 × 256) the float32 logits, 1024·2048·4
    bytes; at the end of backward (batch 1 × 16) a block's weights, 754,176·4."""
    loss, end = memory(layout()), memory(layout(), batch=1, seq_len=16)
    assert (loss.phase, end.phase) == ("loss backward", "end of backward")
    assert loss.allocator == 1024 * 2048 * 4 and end.allocator == DEBUG_LAYER * 4
    assert loss.reserved == loss.active + loss.allocator


def test_fsdps_gradients_keep_their_own_streams_pool_beside_the_losss_peak() -> None:
    """FSDP 2, fp32, batch 4 × 256: the loss's backward (no gradients live yet) is the peak; its
    reserved memory holds, beside the compute stream's peak and the largest transient block, the
    sharded gradients the reduce-scatter stream wrote (a view of its output: they stay in its pool)
    and the all-gather copy-in stream's flat buffers of the last two units gathered (two blocks,
    larger here than a block and the head)."""
    m = memory(layout(dp_shard=2))
    assert m.phase == "loss backward" and m.gradients == 0
    sharded_grads = DEBUG_PARAMS // 2 * 4
    head, block = DEBUG_EMBEDDING * 4, DEBUG_LAYER * 4  # the output matrix and a block, gathered in fp32
    logits = 4 * 256 * 2048 * 4  # the largest transient: the float32 logits
    assert m.communication == block + head  # the last block and the head stay gathered after forward
    assert block > head and m.allocator == sharded_grads + 2 * block + logits
    # No FSDP: the gradients are the compute stream's own (the end of backward counts them).
    single = memory(layout())
    assert single.allocator == logits


def test_total_is_the_sum_and_describe_leaves_out_empty_parts() -> None:
    m = RankMemory(
        parameters=GIB, buffers=0, gradients=0, optimizer_state=2 * GIB, activations=GIB // 2,
        logits=0, temporaries=0, communication=0, allocator=0, process=GIB // 4,
    )  # fmt: skip
    assert m.total == m.reserved == GIB * 15 // 4 and m.active == GIB * 14 // 4
    assert m.describe() == "parameters 1.0 + optimizer state 2.0 + activations 0.5 + process 0.2 GiB"


def _held_by_each_pp_rank(m: ModelConfig, p: ParallelismConfig) -> list[int]:
    """Parameters each pipeline rank's parts hold, as the trainer cuts the (meta) model."""
    with torch.device("meta"):
        model = build_model(m)
    plan = StagePlan.from_config(p, m.n_layers)
    pp = p.pipeline_parallel_degree
    held = []
    for rank in range(pp):
        parts = model.pipeline_stages(plan, plan.stage_ids(rank, pp, p.pipeline_parallel_schedule))
        held.append(sum(t.numel() for part in parts for t in part.parameters()))
    return held


@pytest.mark.parametrize(
    "n_layers,pp,schedule",
    [
        (8, 2, "1F1B"),
        (6, 3, "1F1B"),
        (8, 2, "Interleaved1F1B"),
        (8, 2, "LoopedBFS"),
        (8, 2, "ZBVZeroBubble"),  # rank 0 holds the first and the last stage
        (8, 2, "DualPipeV"),
        (6, 2, "Interleaved1F1B"),  # uneven: stages of 1, 2, 1, 2 layers
    ],
)
def test_the_estimate_holds_the_busiest_pipeline_rank(n_layers: int, pp: int, schedule: str) -> None:
    """The modelled parameters are those of the busiest rank once the model is cut into stages."""
    m = dataclasses.replace(DEBUG, n_layers=n_layers)
    p = layout(pp=pp, schedule=schedule)
    assert part_parameters(m, p) == max(_held_by_each_pp_rank(m, p))


def test_the_estimate_is_the_busiest_pipeline_rank_with_its_allocator() -> None:
    """1F1B over stages of 1, 2, 1 and 2 layers: rank r keeps pp - r microbatches (no checkpointing,
    fp32: each layer-microbatch is 5,376 elements × 256 tokens × 4 bytes), the last one the logits
    too; the estimate is the largest of the four reserved totals."""
    w = Workload(DEBUG, layout(pp=4), NO_AC, 8, 256)
    ranks = [rank_memory(w, pp_rank=r) for r in range(4)]
    assert ranks[1].activations == 3 * 2 * 5_376 * 256 * 4
    assert rank_memory(w).total == max(r.total for r in ranks)


def test_expert_parallel_gathers_a_ranks_own_experts_only() -> None:
    """A MoE model of the debug model's shape (8 experts of 3·256·128 per layer), fsdp4 against
    fsdp4·ep4 at the end of backward: the same sharded states (EP borrows FSDP's ranks), and FSDP's
    units (16 bytes a gathered parameter, as for a dense model) hold 2 of the 8 experts."""
    moe = dataclasses.replace(DEBUG, moe=MoEConfig(num_experts=8, top_k=2, hidden_dim=128))
    experts = 8 * 3 * 256 * 128
    fsdp = memory(layout(dp_shard=4), m=moe, batch=1, seq_len=16)
    expert_parallel = memory(layout(dp_shard=4, ep=4), m=moe, batch=1, seq_len=16)
    assert fsdp.phase == expert_parallel.phase == "end of backward"
    assert expert_parallel.parameters == fsdp.parameters and expert_parallel.optimizer_state == fsdp.optimizer_state
    assert fsdp.communication == 16 * layer_parameters(moe)
    assert expert_parallel.communication == 16 * (layer_parameters(moe) - experts + experts / 4)
    # TP splitting the experts too: each rank's 2 of 8 experts by half their hidden dim, as the dense weights.
    split = memory(layout(dp_shard=4, tp=2, ep=4, etp=2), m=moe, batch=1, seq_len=16)
    assert split.communication == pytest.approx(16 * (layer_parameters(moe) - experts + experts / 4) / 2)


def test_only_latent_attention_leaves_matmul_work_whole_under_tensor_parallelism() -> None:
    """DeepSeek-V3's wq_a and wkv_a run whole on every tp rank (256·(128 + 128 + 32) multiply-adds a
    token of the debug model's), a share that longer sequences' attention scores dilute; a Llama's
    or a Qwen3's every matmul is split."""
    deepseek = OmegaConf.to_object(compose_config(["model=deepseek_v3_debug"])).model
    short, long = (whole_under_tensor_parallel(deepseek, seq_len) for seq_len in (256, 4096))
    assert 0 < long < short < 0.1
    active = layer_parameters(deepseek) - inactive_parameters(deepseek) / deepseek.n_layers
    assert short == pytest.approx(256 * (128 + 128 + 32) / (active + 128 * 8 * (64 + 32)))
    for name in ("llama3_debug", "qwen3_moe_debug"):
        assert whole_under_tensor_parallel(OmegaConf.to_object(compose_config([f"model={name}"])).model, 256) == 0


def test_fsdp_accumulating_unreduced_gradients_holds_every_unit_unsharded(llama3_8b: ModelConfig) -> None:
    """Llama 3 8B, FSDP 8, bf16 parameters, fp32 reduction, 4 microbatches. Reducing every
    microbatch, what earlier microbatches leave at the loss's backward is the sharded fp32
    gradients (8.0e9 · 4 B / 8); reducing after the last only, every unit's unsharded gradient in
    the reduce dtype (8.0e9 · 4 B = 30 GiB). Reserved, those come on the compute stream's pool and
    the step's sharded gradients still on the reduce-scatter stream's: all 30 GiB more. At
    accumulation 1 the setting changes nothing."""
    p, params = layout(dp_shard=8), model_parameters(llama3_8b)
    kw = {"m": llama3_8b, "batch": 1, "seq_len": 8192, "param_dtype": "bfloat16", "reduce_dtype": "float32"}
    every = memory(p, accumulation=4, gradient_sync="every_microbatch", **kw)
    last = memory(p, accumulation=4, gradient_sync="last_microbatch", **kw)
    assert every.phase == last.phase == "loss backward"
    assert every.gradients == pytest.approx(params * 4 / 8, rel=1e-3)
    assert last.gradients == pytest.approx(params * 4, rel=1e-3)
    assert last.active - every.active == pytest.approx(params * 4 * 7 / 8, rel=0.01)
    assert last.reserved - every.reserved == pytest.approx(params * 4, rel=0.01)
    single = [memory(p, accumulation=1, gradient_sync=sync, **kw) for sync in ("every_microbatch", "last_microbatch")]
    assert single[0] == single[1]

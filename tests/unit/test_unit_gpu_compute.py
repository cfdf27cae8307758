"""titan_exp/estimate/gpu_compute.py: a rank's GPU compute op by op, on an H100 profile: hand-derived
where the op is one formula, and the directions the options move it (float8, compile, AC, TP)."""

import dataclasses

import pytest
from layouts import layout
from omegaconf import OmegaConf

from titan_exp.estimate.gpu_compute import (
    _attention,
    _elementwise_bytes,
    _gemm,
    _gradient_sums_bytes,
    _linear,
    attention_kernel,
    block_seconds,
    gpu_compute,
    head_seconds,
    linear_shapes,
    recomputed_by_op_ac,
)
from titan_exp.estimate.hardware_profiles import hardware_profiles
from titan_exp.estimate.workload import Workload
from titan_exp.models.config import ModelConfig
from titan_exp.parallel.config import ActivationCheckpointConfig

from conftest import compose_config

H100 = hardware_profiles()["h100"]
# Llama 3 8B's shapes, FSDP 8, one microbatch of 2 × 8192 tokens in bfloat16.
LLAMA3_8B = ModelConfig(
    dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256, ffn_dim_multiplier=1.3, multiple_of=1024
)


def workload(**changes) -> Workload:
    ac = changes.pop("ac", ActivationCheckpointConfig())
    base = Workload(LLAMA3_8B, layout(dp_shard=8), ac, 2, 8192, param_dtype="bfloat16")
    return dataclasses.replace(base, **changes)


def test_a_large_gemm_runs_at_the_profiles_sustained_rate() -> None:
    """16,384 × 14,336 × 4,096 in bf16: full waves (128 × 56 tiles over 132 SMs: 54.3 waves, the last
    partial), compute-bound: FLOPs / (989 TFLOP/s × efficiency × the waves' share)."""
    tiles = 128 * 56
    waves = -(-tiles // 132)
    expected = 2 * 16_384 * 14_336 * 4096 / (989e12 * H100.matmul_efficiency * tiles / (waves * 132))
    assert _gemm(H100, 16_384, 14_336, 4096, "bfloat16", workload()) == pytest.approx(expected)


def test_a_gemm_too_small_to_fill_the_sms_is_less_efficient() -> None:
    """Per FLOP, 256 output columns in one column of tiles (a TP-8 shard's K/V projection at a
    small batch) take longer than the large shape."""
    w = workload()
    large = _gemm(H100, 16_384, 14_336, 4096, "bfloat16", w) / (16_384 * 14_336 * 4096)
    thin = _gemm(H100, 1024, 128, 4096, "bfloat16", w) / (1024 * 128 * 4096)
    assert thin > 2 * large


def test_float8_speeds_large_linears_once_compile_fuses_its_casts() -> None:
    bf16 = sum(_linear(H100, workload(compiled=True), 16_384, 4096, 14_336))
    f8 = sum(_linear(H100, workload(compiled=True, quantize="tensorwise"), 16_384, 4096, 14_336))
    rowwise = sum(_linear(H100, workload(compiled=True, quantize="rowwise"), 16_384, 4096, 14_336))
    eager_f8 = sum(_linear(H100, workload(quantize="tensorwise"), 16_384, 4096, 14_336))
    assert f8 < rowwise < bf16 and f8 < eager_f8


def test_eager_float8_casts_cost_more_than_its_gemms_save() -> None:
    """Eager, torchao's casts run as six kernels each and backward casts all three tensors again
    from high precision: a large linear in float8 is slower than in bf16, as torchtitan measured
    (PR 812: Llama 3 8B, FSDP 8, op SAC, eager float8 3,985 tokens/s against ~5,700 for bf16)."""
    bf16 = sum(_linear(H100, workload(), 16_384, 4096, 14_336))
    eager_f8 = sum(_linear(H100, workload(quantize="tensorwise"), 16_384, 4096, 14_336))
    gathered_f8 = sum(_linear(H100, workload(quantize="tensorwise", float8_all_gather=True), 16_384, 4096, 14_336))
    assert bf16 < gathered_f8 < eager_f8


def test_compile_removes_bandwidth_bound_work() -> None:
    eager, compiled = block_seconds(H100, workload()), block_seconds(H100, workload(compiled=True))
    assert compiled["forward"] < eager["forward"] and compiled["backward"] < eager["backward"]


def test_recomputation_by_checkpointing_mode() -> None:
    """Full: the forward again; per-op SAC: the unsaved matmuls (wk, wo, w3) and the elementwise
    work; none: nothing; every 2nd block: half the forward."""
    none = block_seconds(H100, workload())
    full = block_seconds(H100, workload(ac=ActivationCheckpointConfig(mode="full")))
    op = block_seconds(H100, workload(ac=ActivationCheckpointConfig(mode="selective")))
    every_2 = block_seconds(H100, workload(ac=ActivationCheckpointConfig("selective", "2")))
    assert none["recompute"] == 0 and full["recompute"] == pytest.approx(none["forward"])
    assert every_2["recompute"] == pytest.approx(none["forward"] / 2)
    assert 0 < op["recompute"] < full["recompute"]
    assert recomputed_by_op_ac(list(linear_shapes(workload()))) == ["wk", "wo", "w3"]


def test_tensor_parallel_splits_a_blocks_work() -> None:
    one = sum(block_seconds(H100, workload()).values())
    tp2 = sum(block_seconds(H100, workload(parallelism=layout(dp_shard=4, tp=2))).values())
    assert one / 2 <= tp2 < one


def test_backwards_gradient_sums_are_whole_on_every_tensor_parallel_rank() -> None:
    """Llama's wq, wk and wv read one normed input, w1 and w3 another: three adds of a 4096-wide
    bf16 gradient per token, eager read 2 and write 1 each, compiled one more read each (fused into
    the next kernel); under TP every rank sums the whole gathered sequence's."""
    assert _gradient_sums_bytes(workload()) == 3 * 3 * 4096 * 2
    assert _gradient_sums_bytes(workload(compiled=True)) == 3 * 4096 * 2
    assert _gradient_sums_bytes(workload(parallelism=layout(dp_shard=4, tp=2))) == 3 * 3 * 4096 * 2


def test_qwen3s_query_key_norms_and_wider_heads_cost_pointwise_traffic() -> None:
    """Qwen3-32B's attention spans 64 × 128 = 8192 channels of a 5120-wide model and normalizes q
    and k per head. Against the same model with heads of 80 (spanning dim), eager: 20 bytes an
    element more for the norms over (64 + 8) × 48 more channels and for the rotary over 3456 more
    q and k channels; the output copy and K/V repeat, in bf16, over the wider q and k."""
    shape = {"dim": 5120, "n_layers": 64, "n_heads": 64, "n_kv_heads": 8, "attention_head_dim": 128}
    qwen3 = OmegaConf.to_object(compose_config(["model=qwen3_8b", *(f"model.{k}={v}" for k, v in shape.items())]))
    wide, narrow = qwen3.model, dataclasses.replace(qwen3.model, attention_head_dim=80)
    norms = 20 * (64 + 8) * (128 - 80)
    rotary = 20 * ((64 + 8) * 128 - (64 + 8) * 80)
    copies = (2 * (8 * 128 + 8192) + 2 * 8192 - 2 * (8 * 80 + 5120) - 2 * 5120) * 2
    difference = _elementwise_bytes(workload(model=wide)) - _elementwise_bytes(workload(model=narrow))
    assert difference == pytest.approx(norms + rotary + copies)
    # A model without norms inside attention (Llama) pays only the widths.
    heads = {"dim": 5120, "n_heads": 64, "n_kv_heads": 8, "attention_head_dim": 128}
    llama = dataclasses.replace(LLAMA3_8B, **heads, intermediate_size=wide.intermediate_size)
    assert _elementwise_bytes(workload(model=wide)) - _elementwise_bytes(workload(model=llama)) == pytest.approx(
        20 * (64 + 8) * 128
    )


def test_a_compiled_loss_costs_less_than_the_float32_one() -> None:
    assert head_seconds(H100, workload(loss_compiled=True)) < head_seconds(H100, workload())


@pytest.mark.parametrize("implementation, step_bytes", [("fused", 28), ("foreach", 80), ("for-loop", 80)])
def test_the_optimizer_streams_its_kernels_bytes_a_local_parameter(implementation: str, step_bytes: int) -> None:
    """AdamW over the 8B model's FSDP-8 shard, after the gradient-norm clip (read 4, scale 4 + 4):
    fused, one pass (read 16, write 12); foreach and for-loop, a pass per op (80) at 3.35 TB/s ×
    efficiency."""
    expected = (step_bytes + 12) * 8_030_261_248 / 8 / (3350e9 * H100.memory_efficiency)
    assert gpu_compute(workload(optimizer=implementation), H100).optimizer == pytest.approx(expected)


def _model(name: str) -> ModelConfig:
    return OmegaConf.to_object(compose_config([f"model={name}"])).model


def test_latent_attention_is_timed_by_its_own_linears() -> None:
    """DeepSeek-V3 16B: a query projection, the key-value latent (whole under TP), its up-projection
    and the output: the linears hold the attention's weights, norms aside, and TP splits all but
    the latent's."""
    m = _model("deepseek_v3_16b")
    one = linear_shapes(workload(model=m))
    tp2 = linear_shapes(workload(model=m, parallelism=layout(dp_shard=4, tp=2)))
    assert list(one)[:4] == ["wq", "wkv_a", "wkv_b", "wo"]
    norms = m.mla.kv_lora_rank + m.mla.q_lora_rank
    assert sum(one[name][0] * one[name][1] for name in list(one)[:4]) == m.attention_parameters() - norms
    assert tp2["wkv_a"] == one["wkv_a"] and tp2["wkv_b"][1] == one["wkv_b"][1] / 2 and tp2["wo"][0] == one["wo"][0] / 2


def test_routed_experts_cost_more_than_the_same_flops_in_one_dense_gemm_when_each_gets_few_rows() -> None:
    """Qwen3-30B-A3B's experts at 2 × 8192 tokens (1,024 rows an expert: whole tiles) against 2 × 64
    tokens (8 rows an expert, each in a tile of 128): per routed row, the few rows cost far more."""
    m = _model("qwen3_30b_a3b")
    many, few = (workload(model=m, local_batch_size=2, seq_len=seq) for seq in (8192, 64))
    per_row = [sum(block_seconds(H100, w).values()) / w.tokens for w in (many, few)]
    assert per_row[1] > 3 * per_row[0]


def test_expert_parallelism_adds_the_regrouping_passes_and_spreads_the_experts() -> None:
    """fsdp8·ep8 against fsdp8: each rank runs 16 of 128 experts over as many rows in all, so its
    expert GEMMs take as long (each expert gets 8 times the rows: the same whole tiles here), and the
    received rows are regrouped by local expert and back (4 more passes over the routed rows)."""
    m = _model("qwen3_30b_a3b")
    plain = block_seconds(H100, workload(model=m))
    ep = block_seconds(H100, workload(model=m, parallelism=layout(dp_shard=8, ep=8)))
    assert ep["forward"] > plain["forward"]
    extra = 4 * m.moe.top_k * m.dim * 2 * 2 * 8192 * m.num_moe_layers / m.n_layers / (3350e9 * H100.memory_efficiency)
    assert ep["forward"] - plain["forward"] == pytest.approx(extra, rel=0.05)


def test_latent_attentions_narrower_values_take_sdpas_memory_efficient_kernel() -> None:
    """SDPA's flash kernel needs one head width for q, k and v: DeepSeek-V3's 192-wide queries and
    keys against 128-wide values run the memory-efficient kernel, slower than flash at the same
    FLOPs, most of all in backward; a document mask runs FlexAttention, a little slower than flash."""
    latent, llama = _model("deepseek_v3_16b"), workload()
    assert [attention_kernel(w) for w in (llama, workload(model=latent))] == ["flash", "efficient"]
    assert attention_kernel(workload(masked_keys=512.0)) == "flex"
    assert attention_kernel(workload(model=_model("gpt_oss_20b"))) == "flex"  # its sinks: FlexAttention only
    assert attention_kernel(workload(param_dtype="float32")) == "math"
    # The same FLOPs (one width for both products) through each kernel.
    same_flops = dataclasses.replace(latent, mla=dataclasses.replace(latent.mla, v_head_dim=latent.mla.qk_head_dim))
    flash_forward, flash_backward = _attention(H100, workload(model=same_flops))
    unequal = dataclasses.replace(same_flops.mla, qk_nope_head_dim=127, v_head_dim=193)
    efficient = dataclasses.replace(same_flops, mla=unequal)
    assert efficient.attention_flops_dim == same_flops.attention_flops_dim
    forward, backward = _attention(H100, workload(model=efficient))
    assert flash_forward < forward < 1.5 * flash_forward
    assert backward > 1.5 * flash_backward

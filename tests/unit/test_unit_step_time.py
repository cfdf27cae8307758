"""titan_exp/estimate/step_time.py: how the step's communication and pipeline bubble respond to
bandwidth, overlap, async TP, the pipeline degree and the number of microbatches (hand-derived
where the formula is simple). The per-op GPU compute: test_unit_gpu_compute.py."""

import dataclasses

import pytest
from layouts import layout

from titan_exp.estimate.collectives import collective_seconds, point_to_point_seconds
from titan_exp.estimate.config import HardwareConfig
from titan_exp.estimate.gpu_compute import gpu_compute
from titan_exp.estimate.hardware_profiles import hardware_profiles
from titan_exp.estimate.step_time import ComputeTimes, StepTime, step_time
from titan_exp.estimate.workload import Workload, layer_parameters, model_parameters
from titan_exp.models.common.moe.config import MoEConfig
from titan_exp.models.config import ModelConfig
from titan_exp.parallel.config import ActivationCheckpointConfig, ParallelismConfig

DEBUG = ModelConfig()  # 6 layers of 754,176 parameters, dim 256, 16 heads of 16, vocab 2048
# A made-up GPU with round figures.
HW = HardwareConfig(
    name="test",
    device="cuda",
    peak_tflops_float32=50.0,
    peak_tflops_bfloat16=100.0,
    peak_tflops_float8=200.0,
    matmul_efficiency=0.5,
    float8_matmul_efficiency=0.5,
    attention_efficiency=0.5,
    memory_efficiency=1.0,
    sm_count=100,
    memory_gib=80.0,
    memory_gbps=1000.0,
    intra_node_gbps=100.0,
    inter_node_gbps=10.0,
    collective_latency_us=10.0,
    reduce_latency_us=20.0,
    devices_per_node=8,
    overlaps_communication=True,
)
BLOCKING = dataclasses.replace(HW, overlaps_communication=False)
# The cpu profile (gloo between rank processes) with the made-up links in place of its measured ones.
CPU = dataclasses.replace(
    hardware_profiles()["cpu"],
    **{name: getattr(HW, name) for name in ("intra_node_gbps", "collective_latency_us", "reduce_latency_us")},
)
# Per microbatch: a layer's forward + backward, the output head's; the optimizer step once.
COMPUTE = ComputeTimes(layer=0.01, head=0.02, optimizer=0.05)


def reductions(hw: HardwareConfig, world: int) -> float:
    """The step's three small all-reduces (loss, grad norm): priced by estimate/collectives.py
    (test_unit_collectives.py), counted here."""
    return 3 * collective_seconds(hw, 4, world, 1, "all_reduce")


def step(
    p: ParallelismConfig,
    hw: HardwareConfig = HW,
    *,
    m: ModelConfig = DEBUG,
    batch: int = 4,
    accumulation: int = 1,
    param_bytes: int = 4,
    oversubscription: float = 1.0,
    async_tp: bool = False,
    imbalance: float = 1.0,
    quantize: str = "none",
    gradient_sync: str = "every_microbatch",
) -> StepTime:
    dtype = {4: "float32", 2: "bfloat16"}[param_bytes]
    ac = ActivationCheckpointConfig()
    w = Workload(
        m,
        p,
        ac,
        batch,
        256,
        accumulation,
        param_dtype=dtype,
        quantize=quantize,
        async_tp=async_tp,
        expert_load_imbalance=imbalance,
        gradient_sync=gradient_sync,
    )
    return step_time(w, hw, COMPUTE, oversubscription)


def test_single_device_step_is_compute_only() -> None:
    """Batch 4 (one microbatch without a pipeline) × 2 accumulation steps: 2·(6·0.01 + 0.02) + 0.05."""
    s = step(layout(), accumulation=2)
    assert s.compute == pytest.approx(2 * (6 * 0.01 + 0.02) + 0.05)
    assert s.communication == 0.0 and s.bubble == 0.0
    assert s.total == pytest.approx(s.compute)


def test_ranks_sharing_cores_stretch_the_busy_time_and_fill_the_bubble() -> None:
    """Unshared, the bubble adds to the busy time; ranks sharing cores stretch it, and a rank idle
    in its bubble lends its core, so the bubble shows only beyond the stretch."""
    alone = step(layout(dp_shard=2, pp=2), BLOCKING, batch=4)
    busy = alone.compute + alone.communication
    assert alone.communication > 0 and alone.bubble > 0
    assert set(alone.breakdown()) == {"compute", "communication", "bubble", "oversubscription", "total"}
    assert alone.total == pytest.approx(busy + alone.bubble)
    shared = step(layout(dp_shard=2, pp=2), BLOCKING, batch=4, oversubscription=4.0)
    assert shared.bubble == alone.bubble and 4 * busy > busy + alone.bubble
    assert shared.total == pytest.approx(4 * busy)
    barely = step(layout(dp_shard=2, pp=2), BLOCKING, batch=4, oversubscription=1.01)
    assert barely.total == pytest.approx(busy + alone.bubble)


def test_ddp_all_reduce_by_hand() -> None:
    """DDP over 2 replicas, blocking: one all-reduce of the fp32 gradients (2·½·4·N bytes) plus the
    step's three small reductions (loss, grad norm)."""
    s = step(layout(dp_replicate=2), BLOCKING)
    gradients = 4 * model_parameters(DEBUG)
    expected = 20e-6 + gradients / 100e9 + reductions(BLOCKING, 2)
    assert s.communication == pytest.approx(expected)


def test_fsdp_by_hand() -> None:
    """FSDP over 2 ranks, blocking (gloo): 7 units (6 layers, the root with the embedding, norm and
    output); per microbatch 2·7 - 2 = 12 all-gathers of a unit's parameters, and 7 reduce-scatters
    of fp32 gradients."""
    n = model_parameters(DEBUG)
    s = step(layout(dp_shard=2), BLOCKING, param_bytes=2)
    gather = 10e-6 + n * 2 / 7 / 2 / 100e9
    scatter = 20e-6 + n * 4 / 7 / 2 / 100e9
    assert s.communication == pytest.approx(12 * gather + 7 * scatter + reductions(BLOCKING, 2))


@pytest.mark.parametrize("sync,reductions", [("every_microbatch", 2), ("last_microbatch", 1)])
def test_fsdp_copies_its_units_on_the_compute_stream_by_hand(sync: str, reductions: int) -> None:
    """FSDP over 2 ranks, bf16 parameters, fp32 reduction, 2 microbatches: per microbatch each of
    the 6 layers gathered twice (forward, backward) and the root (embedding, norm, output) once,
    each copied out of its flat buffer (read 2 B, write 2 B an element); per reduction (each
    microbatch, or the last only) every unit's gradients copied into the reduce-scatter's input
    (read 2 B, write 4 B), at 1000 GB/s. DDP copies nothing of the kind."""
    n, layer = model_parameters(DEBUG), layer_parameters(DEBUG)
    root = n - 6 * layer
    copied_out = 2 * 2 * (2 * 6 * layer + root) * 2
    copied_in = (2 + 4) * n * reductions
    fsdp = step(layout(dp_shard=2), HW, param_bytes=2, accumulation=2, gradient_sync=sync)
    assert fsdp.compute == pytest.approx(2 * (6 * 0.01 + 0.02) + 0.05 + (copied_out + copied_in) / 1000e9)
    assert step(layout(dp_replicate=2), HW, param_bytes=2, accumulation=2, gradient_sync=sync).compute == pytest.approx(
        2 * (6 * 0.01 + 0.02) + 0.05
    )


@pytest.mark.parametrize("p", [layout(dp_shard=4), layout(dp_replicate=4), layout(dp_replicate=2, dp_shard=2)])
def test_reducing_every_microbatch_repeats_the_gradient_collectives(p: ParallelismConfig) -> None:
    """On blocking links, 4 microbatches: reducing after each runs the gradients' collectives 4
    times instead of once (3 more, R each); FSDP's gathers repeat every microbatch either way, so
    once-a-step at 4 microbatches costs more than 1 microbatch under FSDP and the same under DDP."""
    once = step(p, BLOCKING, accumulation=4, gradient_sync="last_microbatch").communication
    every = step(p, BLOCKING, accumulation=4, gradient_sync="every_microbatch").communication
    single = step(p, BLOCKING, accumulation=1).communication
    reduction = (every - once) / 3
    assert reduction > 0
    assert reduction < single  # one reduction is part of what one microbatch communicates
    if p.data_parallel_shard_degree > 1:
        assert once > single
    else:
        assert once == pytest.approx(single)


@pytest.mark.parametrize(
    "p",
    [layout(dp_shard=4), layout(dp_replicate=4), layout(tp=4), layout(cp=4), layout(pp=2), layout(dp_shard=2, tp=2)],
    ids=["fsdp", "ddp", "tp", "cp", "pp", "fsdp_tp"],
)
def test_more_bandwidth_less_communication(p: ParallelismConfig) -> None:
    slow, fast = BLOCKING, dataclasses.replace(BLOCKING, intra_node_gbps=400.0)
    assert 0 < step(p, fast, batch=4).communication < step(p, slow, batch=4).communication


def test_a_shard_group_beyond_a_node_runs_on_the_slower_link() -> None:
    """dp_shard 16 with 8 devices per node crosses nodes (10 GB/s); with 16 per node it does not."""
    across, within = BLOCKING, dataclasses.replace(BLOCKING, devices_per_node=16)
    assert step(layout(dp_shard=16), across).communication > step(layout(dp_shard=16), within).communication


def test_on_the_cpu_profile_fsdp_blocks() -> None:
    """gloo's collectives block (titan_exp/conf/hardware/cpu.yaml): the same by hand as test_fsdp_by_hand."""
    assert not CPU.overlaps_communication
    n = model_parameters(DEBUG)
    gather = 10e-6 + n * 2 / 7 / 2 / 100e9
    scatter = 20e-6 + n * 4 / 7 / 2 / 100e9
    expected = 12 * gather + 7 * scatter + reductions(CPU, 2)
    assert step(layout(dp_shard=2), CPU, param_bytes=2).communication == pytest.approx(expected)


def test_overlapped_fsdp_shows_only_what_nothing_covers() -> None:
    """One microbatch, fp32, dp_shard 2, a layer's compute (10 ms) far above a unit's collectives:
    no layer's gather or reduce-scatter shows, nor the head's (behind its 20 ms); only the first
    all-gather and the last reduce-scatter of a block (754,176 · 4 bytes, half through each link)
    and the step's 3 small reductions, however many layers. Blocking, every collective adds up."""
    overlapped, blocking = step(layout(dp_shard=2), HW), step(layout(dp_shard=2), BLOCKING)
    gather, scatter = (collective_seconds(HW, 754_176 * 4, 2, 1, kind) for kind in ("all_gather", "reduce_scatter"))
    assert overlapped.communication == pytest.approx(gather + scatter + reductions(HW, 2))
    assert step(layout(dp_shard=2), HW, m=DEEP).communication == pytest.approx(overlapped.communication)
    assert overlapped.communication < blocking.communication
    assert overlapped.compute == blocking.compute


def test_overlap_cannot_hide_more_than_compute() -> None:
    """A very slow link: against the same step with no compute to hide behind, overlap hides
    something, and at most the compute it runs beside."""
    slow = dataclasses.replace(HW, intra_node_gbps=0.001)
    w = Workload(DEBUG, layout(dp_shard=2), ActivationCheckpointConfig(), 4, 256)
    overlapped = step_time(w, slow, COMPUTE)
    bare = step_time(w, slow, ComputeTimes(layer=0.0, head=0.0, optimizer=0.0))
    hidden = bare.communication - overlapped.communication
    assert 0 < hidden <= overlapped.compute


# A TP collective over 2 ranks of one microbatch's activations, batch 4 × 256 × dim 256, fp32.
TP2_ACTIVATION = 4 * 256 * 256 * 4  # a microbatch of 4 × 256 tokens, dim 256, float32
TP2_GATHER = collective_seconds(HW, TP2_ACTIVATION, 2, 1, "all_gather")
TP2_PAIR = TP2_GATHER + collective_seconds(HW, TP2_ACTIVATION, 2, 1, "reduce_scatter")
# torch's functional collectives re-lay along the sequence what they gather (the batch is 4, not 1)
# and what they reduce-scatter: the activation read and written once more, at 1000 GB/s.
TP2_COPY = 2 * TP2_ACTIVATION / 1000e9


def test_tensor_parallel_by_hand() -> None:
    """Per layer an all-gather and a reduce-scatter around attention and the MLP, in forward and
    backward (4 pairs), 2 more pairs with full checkpointing's recomputation, each collective with
    its copy; the head's 2 all-gathers; the step's 3 small reductions."""
    head = 2 * TP2_GATHER + reductions(HW, 2)
    assert step(layout(tp=2)).communication == pytest.approx(6 * 4 * (TP2_PAIR + 2 * TP2_COPY) + head)
    w = Workload(DEBUG, layout(tp=2), ActivationCheckpointConfig(mode="full"), 4, 256)
    assert step_time(w, HW, COMPUTE).communication == pytest.approx(6 * 6 * (TP2_PAIR + 2 * TP2_COPY) + head)


def test_float8_tensor_parallel_gathers_float8_inputs_in_forward() -> None:
    """Tensorwise float8 gathers the column-wise linears' inputs cast to one byte an element: the
    forward's two all-gathers (and their copies) move a quarter of float32's bytes."""
    f8 = step(layout(tp=2), quantize="tensorwise").communication
    forward_gathers = 2 * (TP2_GATHER + TP2_COPY)
    quarter = 2 * (collective_seconds(HW, TP2_ACTIVATION / 4, 2, 1, "all_gather") + TP2_COPY / 4)
    assert step(layout(tp=2)).communication - f8 == pytest.approx(6 * (forward_gathers - quarter))


def test_async_tensor_parallel_hides_a_quarter_of_a_layers_collectives() -> None:
    """Hideable: all but the first of tp = 2 chunks (half), of which async TP hides half in practice:
    a quarter of each layer's 8 collectives, well within its 10 ms of compute; and its fused
    matmuls make none of the copies."""
    hidden = step(layout(tp=2)).communication - step(layout(tp=2), async_tp=True).communication
    assert hidden == pytest.approx(6 * (4 * TP2_PAIR / 4 + 8 * TP2_COPY))


def test_pipeline_sends_by_hand() -> None:
    """pp 2, 4 microbatches of 1 × 256 tokens, fp32: per microbatch a send forward and a receive
    backward of 256 · 256 · 4 bytes on the 100 GB/s link; the step's 3 small reductions."""
    send = point_to_point_seconds(HW, 256 * 256 * 4, across_nodes=False)
    assert step(layout(pp=2)).communication == pytest.approx(4 * 2 * send + reductions(HW, 2))


def test_context_parallel_by_hand() -> None:
    """cp 4 shards FSDP as dp_shard 4 does; beyond that, per layer an all-gather of K and V (256 of
    the 1024 tokens a rank, 2 · 4 kv heads · 16 · 4 bytes, 4 ranks' worth) and its gradients back."""
    kv = 256 * 2 * 4 * 16 * 4 * 4
    extra = step(layout(cp=4)).communication - step(layout(dp_shard=4)).communication
    assert extra == pytest.approx(6 * 2 * collective_seconds(HW, kv, 4, 1, "all_gather"))


def test_tensor_parallel_collectives_are_blocking_unless_async() -> None:
    plain = step(layout(tp=2), HW).communication
    assert reductions(HW, 2) < step(layout(tp=2), HW, async_tp=True).communication < plain
    # Async TP needs streams: on gloo nothing overlaps.
    blocking = step(layout(tp=2), BLOCKING).communication
    assert step(layout(tp=2), BLOCKING, async_tp=True).communication == blocking


# 16 layers so that every pipeline degree below splits them.
DEEP = dataclasses.replace(DEBUG, n_layers=16)


def bubble_share(p: ParallelismConfig, batch: int) -> float:
    s = step(p, m=DEEP, batch=batch)
    return s.bubble / (s.compute - COMPUTE.optimizer)


@pytest.mark.parametrize("pp,microbatches", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 8)])
def test_1f1b_bubble_is_pp_minus_one_over_microbatches(pp: int, microbatches: int) -> None:
    """(pp - 1) / (v·m) of the useful work, v = 1 stage per rank."""
    assert bubble_share(layout(pp=pp), microbatches) == pytest.approx((pp - 1) / microbatches)


def test_bubble_grows_with_pipeline_degree_and_shrinks_with_microbatches() -> None:
    shares = [bubble_share(layout(pp=pp), 8) for pp in (2, 4, 8)]
    assert shares == sorted(shares) and len(set(shares)) == 3
    shares = [bubble_share(layout(pp=4), m) for m in (4, 8, 16)]
    assert shares == sorted(shares, reverse=True) and len(set(shares)) == 3


def test_interleaving_halves_the_bubble_and_zero_bubble_quarters_it() -> None:
    one_f_one_b = bubble_share(layout(pp=4), 8)
    assert bubble_share(layout(pp=4, schedule="Interleaved1F1B"), 8) == pytest.approx(one_f_one_b / 2)
    # 0.25 of (pp - 1)/(v·m), v = 2.
    assert bubble_share(layout(pp=4, schedule="ZBVZeroBubble"), 8) == pytest.approx(0.25 * one_f_one_b / 2)
    assert bubble_share(layout(pp=4, schedule="InterleavedZeroBubble"), 8) == pytest.approx(0.25 * one_f_one_b / 2)


def test_pipeline_rank_computes_its_layers_and_the_head_per_microbatch() -> None:
    """pp 4 over 16 layers, 8 microbatches: 8·(4·0.01 + 0.02) + 0.05."""
    assert step(layout(pp=4), m=DEEP, batch=8).compute == pytest.approx(8 * (4 * 0.01 + 0.02) + 0.05)


def test_impossible_pipeline_split_is_refused() -> None:
    with pytest.raises(ValueError):
        step(layout(pp=8), batch=8)  # 8 stages, 6 layers


def test_async_tensor_parallel_is_no_slower_on_an_h100() -> None:
    """Llama 3 8B's shapes, TP 8 × FSDP 8, 2 × 8192 tokens in bfloat16, compute modelled op by op on
    the h100 profile: async TP shortens the step, and changes neither compute nor bubble."""
    h100 = hardware_profiles()["h100"]
    m = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256, multiple_of=1024)
    plain = Workload(m, layout(dp_shard=8, tp=8), ActivationCheckpointConfig(), 2, 8192, param_dtype="bfloat16")
    overlapped = dataclasses.replace(plain, async_tp=True)
    before, after = (step_time(w, h100, gpu_compute(w, h100)) for w in (plain, overlapped))
    assert after.total < before.total
    assert (after.compute, after.bubble) == (before.compute, before.bubble)


def test_pipeline_sends_between_nodes_run_on_the_slower_link() -> None:
    """dp_shard 8 fits a node of 8 either way; the pp peers (8 ranks apart) share a node of 16 only."""
    p = layout(dp_shard=8, pp=2)
    across, within = BLOCKING, dataclasses.replace(BLOCKING, devices_per_node=16)
    assert step(p, across).communication > step(p, within).communication


def test_v_shaped_ranks_compute_the_layers_they_hold() -> None:
    """pp 2 over 6 layers, 4 microbatches: rank 0 holds stages 0 and 3 (3 layers and the head):
    4·(3·0.01 + 0.02) + 0.05."""
    assert step(layout(pp=2, schedule="ZBVZeroBubble"), batch=4).compute == pytest.approx(4 * (3 * 0.01 + 0.02) + 0.05)


# A MoE model of the debug model's shape: 6 MoE layers of 8 experts, top-2, each expert's SwiGLU 128 wide.
MOE = dataclasses.replace(DEBUG, moe=MoEConfig(num_experts=8, top_k=2, hidden_dim=128))


def test_expert_parallel_by_hand() -> None:
    """fsdp4·ep4, blocking, one microbatch of 4 × 256 tokens. Per MoE layer four all-to-alls
    (dispatch and combine, forward and backward) of the rank's 1024 · 2 routed rows of 256 fp32
    values, ¾ of them leaving the rank. FSDP gathers each layer's dense weights over 4 ranks (11
    times: forward, backward but the last) and its 2 of 8 experts over no one (EP leaves no
    data-parallel rank); the root (embeddings, norm and output) once, on gloo."""
    s = step(layout(dp_shard=4, ep=4), BLOCKING, m=MOE)
    link = 3 / 4 / 100e9  # seconds per byte leaving a rank of 4
    all_to_all = 10e-6 + 4 * 256 * 2 * 256 * 4 * link
    dense = layer_parameters(MOE) - 8 * 3 * 256 * 128
    outside = model_parameters(MOE) - 6 * layer_parameters(MOE)
    gathers = 11 * (10e-6 + dense * 4 * link) + (10e-6 + outside * 4 * link)
    scatters = 6 * (20e-6 + dense * 4 * link) + (20e-6 + outside * 4 * link)
    assert s.communication == pytest.approx(6 * 4 * all_to_all + gathers + scatters + reductions(BLOCKING, 4))


def test_experts_split_by_tp_exchange_every_tp_ranks_rows_over_ep_ranks_outside_tp() -> None:
    """fsdp2·tp2·ep2, blocking, 4 × 256 tokens, against the same layout with TP splitting the
    experts (etp 2). Whole experts: EP spans the tp pair, each rank sends its 512-token slice's
    rows, a MoE layer has attention's 4 TP collectives only, and each rank's 4 of 8 experts are
    FSDP-sharded over the 2 dp_shard ranks. Split: EP pairs the dp_shard ranks, each rank sends
    every tp rank's rows (1024 tokens), the layer's all-gather and reduce-scatter come back (8 TP
    collectives, as a dense layer's), and the experts, 4 by half their hidden dim, are FSDP-sharded
    over no one."""
    whole, split = (step(layout(dp_shard=2, tp=2, ep=2, etp=etp), BLOCKING, m=MOE) for etp in (1, 2))
    half_out = 1 / 2 / 100e9  # seconds per byte of a collective over 2 ranks
    activation = 1024 * 256 * 4
    # An all-gather and a reduce-scatter (gloo's reducing call costs 20 µs), each with its copy.
    tp_pair = 10e-6 + 20e-6 + 2 * activation * half_out + 2 * (2 * activation / 1000e9)
    exchange = lambda tokens: 10e-6 + tokens * 2 * 256 * 4 * half_out  # noqa: E731 (top-2 rows, fp32)
    experts = 8 * 3 * 256 * 128 / 2  # a rank's experts under etp 1, gathered in fp32
    fsdp_experts = 11 * (10e-6 + experts * 4 * half_out) + 6 * (20e-6 + experts * 4 * half_out)
    extra = 6 * (2 * tp_pair + 4 * (exchange(1024) - exchange(512))) - fsdp_experts
    assert split.communication == pytest.approx(whole.communication + extra)


def test_expert_parallel_within_a_node_beats_across_nodes() -> None:
    """The all-to-all runs on the node's links while EP fits in one (8 devices), on the slower ones beyond."""
    within = step(layout(dp_shard=16, ep=8), BLOCKING, m=MOE).communication
    across = step(layout(dp_shard=16, ep=16), BLOCKING, m=MOE).communication
    assert within < across


def test_the_gpu_models_imbalance_enters_the_step_once() -> None:
    """The GPU model already runs the busiest rank's rows through the experts (gpu_compute): the step
    adds no second stretch on top, which a measured layer (the rows it drew) still gets."""

    def workload(imbalance: float) -> Workload:
        return Workload(MOE, layout(dp_shard=4, ep=4), ActivationCheckpointConfig(), 4, 256,
                        param_dtype="bfloat16", expert_load_imbalance=imbalance)  # fmt: skip

    balanced, skewed = workload(1.0), workload(1.5)
    modelled, plain = gpu_compute(skewed, HW), gpu_compute(balanced, HW)
    assert modelled.imbalanced and modelled.layer > plain.layer
    step_of = step_time(skewed, HW, modelled).compute - step_time(balanced, HW, plain).compute
    assert step_of == pytest.approx(MOE.n_layers * (modelled.layer - plain.layer))
    measured = dataclasses.replace(modelled, imbalanced=False)
    assert step_time(skewed, HW, measured).compute > step_time(skewed, HW, modelled).compute


def test_imbalance_stretches_the_all_to_all_and_the_experts_compute() -> None:
    balanced = step(layout(dp_shard=4, ep=4), BLOCKING, m=MOE)
    skewed = step(layout(dp_shard=4, ep=4), BLOCKING, m=MOE, imbalance=1.5)
    assert skewed.communication > balanced.communication and skewed.compute > balanced.compute
    # Without EP every rank runs exactly its own tokens' rows: the imbalance moves nothing.
    without_ep, balanced_without = (step(layout(dp_shard=4), BLOCKING, m=MOE, imbalance=x) for x in (1.5, 1.0))
    assert without_ep.communication == pytest.approx(balanced_without.communication)
    assert without_ep.compute == pytest.approx(balanced_without.compute)

"""A rank's compute on a GPU, op by op, for one microbatch (torch-free): the ops one transformer
block runs, each timed by what bounds it, summed; the output head and loss; the optimizer step.

- **Matmuls** (the block's seven linears, forward and the two of backward, each with its own
  shape): FLOPs at the dtype's peak × the profile's efficiency for large GEMMs × wave quantization
  (a GEMM runs in 128×256 output tiles, one per SM at a time: a last partial wave idles the rest,
  CUTLASS/cuBLAS's Hopper tiles), or bytes over bandwidth where that is longer (thin shapes).
- **float8** (torchao Float8Linear): the three GEMMs of a linear at the float8 peak, plus the casts
  (an amax read and a scaled cast of the input, the weight and, in backward, the output's gradient;
  transposed copies for the backward GEMMs); compile fuses the casts into their neighbours.
  Rowwise scaling's GEMMs are slower (`_ROWWISE_GEMM`); mxfp8's block-scaled GEMMs run at the
  float8 rate where the tensor cores take MX scales (Blackwell: the `mxfp8` profiles). Compiled,
  tensorwise scales transpose their float8 copies for backward; rowwise and MX scales run along one
  axis, so backward casts the high-precision tensors again along the other. Eager, every cast is
  torchao's composite (`tensor_to_amax`, `_ToFloat8ConstrFunc`, `to_fp8_saturated`: six kernels)
  and backward casts the input, the weight and the output's gradient again from the high-precision
  tensors it saved, each made column-major for `_scaled_mm` (`float8_linear.py`'s backward and
  `float8_ops.preprocess_addmm`, torchao of 2025-01).
- **Attention**: causal, so half the score matrix; backward 2.5× the forward's FLOPs at a lower
  efficiency (FlashAttention-2, Dao 2023, §3 and its H100 figures); at the rate of the kernel it
  runs (`attention_kernel`: SDPA's flash or memory-efficient kernel, or FlexAttention).
- **Bandwidth-bound work** (norms, rotary, SwiGLU, residuals, GQA's K/V repeat, the copies SDPA
  needs): bytes each op reads and writes (`_ELEMENTWISE`), in eager as the model's ops run them
  (nn.RMSNorm and rotary upcast to float32), compiled as inductor fuses each region into one read
  and one write; backward twice the forward's traffic, and the sums of the input gradients of the
  linears that read one tensor (whole on every tp rank: the gathered sequence's). Attention's widths
  are the family's (Qwen3's q/k norms over every head; latent attention's rope channels).
- **Activation checkpointing**: full recomputes the block's forward; torchtitan's selective "op"
  policy keeps every other matmul's output and attention's, so it recomputes wk, wo, w3 (the
  second, fourth and sixth matmuls) and the bandwidth-bound work.
- **Head**: the output matmul, and cross-entropy over float32 logits (bandwidth-bound).
- **Optimizer**: AdamW's step, bandwidth-bound, by implementation (`_OPTIMIZER_BYTES`), after the
  gradient-norm clip (torch's foreach norm reads the fp32 gradients, its foreach scale reads and
  writes them: 12 bytes a parameter).
"""

import dataclasses
import math

from titan_exp.estimate.config import HardwareConfig
from titan_exp.estimate.step_time import ComputeTimes
from titan_exp.estimate.workload import DTYPE_BYTES, Workload, local_parameters
from titan_exp.models.config import Linear

# Output tile of a large Hopper/Blackwell GEMM kernel (cuBLAS, CUTLASS): rows × columns.
_TILE = (128, 256)
# Attention's backward: FLOPs relative to its forward and its efficiency relative to the forward's
# (FlashAttention-2, Dao 2023: 2.5× the matmul work, lower utilisation from the extra reductions).
_ATTENTION_BACKWARD_FLOPS, _ATTENTION_BACKWARD_EFFICIENCY = 2.5, 0.8
# Each attention kernel's (forward, backward) throughput against FlashAttention-2's (float32's math
# path is priced apart, at the float32 matmul rate). FlexAttention:
# 90% and 85% (PyTorch's FlexAttention post, 2024-08). The memory-efficient kernel (xformers'
# CUTLASS kernel, which aten vendors as mem_eff_attention): 43.4 and 27.4 TFLOP/s against 53.1
# and 51.9 (flash-attention's benchmark_flash_attention.py, causal, head dim 64, seq 4096, in
# Dao-AILab/flash-attention issue 416).
_AGAINST_FLASH = {
    "flash": (1.0, 1.0),
    "flex": (0.90, 0.85),
    "efficient": (43.4 / 53.1, 27.4 / 51.9),
    "math": (1.0, 1.0),
}
# Eager SwiGLU's elements moved per hidden channel and token: silu, then multiply (read 3, write 2).
SWIGLU_EAGER_ELEMENTS = 5
# Bandwidth-bound work moves twice its forward's bytes in backward (each op's gradient reads the
# incoming gradient and what it saved, and writes its input's gradient).
BACKWARD_TRAFFIC = 2
# Rowwise-scaled float8 GEMMs against tensorwise ones (torchao's float8 README, GEMM benchmarks on
# H100: rowwise's per-row scales cost ~15% of the GEMM's throughput).
_ROWWISE_GEMM = 0.85
# Bytes per fp32 parameter of AdamW's step (decoupled weight decay) as torch/optim/adam.py runs it:
# fused, one kernel reading weight, gradient and both moments and writing weight and moments (28);
# foreach (_multi_tensor_adam), one pass per op: weight decay (8), lerp of the first moment (12),
# scale and addcmul of the second (8 + 12), its sqrt into a new tensor (8), the bias correction's
# divide and eps's add (8 + 8), addcdiv into the weights (16); for-loop, the same ops tensor by
# tensor (its per-tensor launches left out).
_OPTIMIZER_BYTES = {"fused": 28, "foreach": 80, "for-loop": 80}
_CLIP_BYTES = 4 + 8
# Bytes an element of a bf16 tensor costs per float8 cast. Eager, torchao's six kernels:
# torch.abs (read 2, write 2) and torch.max (read 2) for the amax; .to(float32) (2, 4), the scale's
# multiply (4, 4), clamp (4, 4), .to(float8) (4, 1). Compiled, the amax and the cast fuse into the
# producer: the high-precision read and the float8 write.
_CAST_BYTES = {False: (2 + 2) + 2 + (2 + 4) + (4 + 4) + (4 + 4) + (4 + 1), True: 1 + 1}
# A float8 copy made column-major for `_scaled_mm` (a byte read and written).
_LAYOUT_BYTES = 2


def _waves(hw: HardwareConfig, rows: float, cols: float, groups: float = 1) -> float:
    """The share of a GEMM's SM-time that does work: its tiles (each of `groups` GEMMs of one
    grouped kernel tiled on its own) over whole waves of SMs."""
    tiles = groups * math.ceil(rows / _TILE[0]) * math.ceil(cols / _TILE[1])
    return tiles / (math.ceil(tiles / hw.sm_count) * hw.sm_count)


def _gemm_rate(hw: HardwareConfig, m: float, n: float, k: float, dtype: str) -> float:
    """FLOP/s of an (m×k)·(k×n) GEMM: as the profile's kernel table measured shapes like it, else
    the dtype's peak × the profile's efficiency for large GEMMs × the share of its waves' SMs that work."""
    tables = hw.tables()
    measured = tables.gemm_tflops(m, n, k, dtype) if tables is not None else None
    if measured is not None:
        return measured * 1e12
    efficiency = hw.float8_matmul_efficiency if dtype == "float8" else hw.matmul_efficiency
    return hw.peak_flops(dtype) * efficiency * _waves(hw, m, n)


def _gemm(hw: HardwareConfig, m: float, n: float, k: float, dtype: str, w: Workload) -> float:
    """Seconds of one (m×k)·(k×n) GEMM: its FLOPs at the reachable rate, or its bytes over the
    bandwidth where that is longer."""
    low_precision = dtype == "float8"
    rate = _gemm_rate(hw, m, n, k, dtype)
    if low_precision and w.quantize == "rowwise":
        rate *= _ROWWISE_GEMM
    element = 1 if low_precision else DTYPE_BYTES[w.param_dtype]
    traffic = (m * k + k * n) * element + m * n * DTYPE_BYTES[w.param_dtype]
    return max(2 * m * n * k / rate, traffic / hw.memory_bytes_per_second())


def linear_shapes(w: Workload) -> dict[str, tuple[float, float]]:
    """Each block linear's (in, out) features on one rank, in the order the block runs them: the
    family's attention linears (models/: latent attention's differ from grouped-query's), then the
    dense SwiGLU's (a MoE model's routed experts are timed apart, as a grouped GEMM:
    `_routed_experts`)."""
    m, tp = w.model, w.parallelism.tensor_parallel_degree
    split = {"column": (1, tp), "row": (tp, 1), None: (1, 1)}
    # The dense SwiGLU: a dense layer's, or a MoE layer's shared experts (split by TP as one; its
    # routed ones are not here), their mean width over the layers where the two mix.
    ffn = m.ffn_hidden_dim
    if m.moe.enabled:
        share = m.num_moe_layers / m.n_layers
        ffn = (1 - share) * m.ffn_hidden_dim + share * m.moe.num_shared_experts * m.moe.hidden_dim
    linears = m.attention_linears() | {
        "w1": Linear(m.dim, ffn, "column"),
        "w3": Linear(m.dim, ffn, "column"),
        "w2": Linear(ffn, m.dim, "row"),
    }
    return {
        name: (linear.fan_in / split[linear.split][0], linear.fan_out / split[linear.split][1])
        for name, linear in linears.items()
    }


def _routed_experts(hw: HardwareConfig, w: Workload) -> dict[str, tuple[float, float]]:
    """(forward, backward) seconds of the routed experts' w1, w3 and w2 for one microbatch, averaged
    over the layers: each a grouped GEMM (torch._grouped_mm, models/common/moe/grouped_mm.py) over
    the rank's experts, each expert's rows its own tiles (a partial last row of tiles per expert).
    The rank runs its tokens' top_k rows (every tp rank's where TP splits the experts; under EP the
    busiest rank's, from every EP rank) through num_experts / ep experts. The router's matmul
    (dim × num_experts a token, under 1% of the experts') is left out."""
    m, p = w.model, w.parallelism
    if not m.moe.enabled:
        return {}
    moe, share = m.moe, m.num_moe_layers / m.n_layers
    experts = moe.num_experts / p.expert_parallel_degree
    rows = w.tokens / p.tensor_parallel_degree * w.experts_tp * moe.top_k * w.busiest_rank_rows
    per_expert, hidden = rows / experts, moe.hidden_dim / w.experts_tp
    dtype = w.param_dtype  # torchao's float8 recipe converts nn.Linear only: the experts stay high precision
    times = {}
    for name, (fan_in, fan_out) in {"w1": (m.dim, hidden), "w3": (m.dim, hidden), "w2": (hidden, m.dim)}.items():
        forward = _grouped_gemm(hw, experts, per_expert, fan_out, fan_in, dtype, w)
        backward = _grouped_gemm(hw, experts, per_expert, fan_in, fan_out, dtype, w)
        backward += _grouped_gemm(hw, experts, fan_in, fan_out, per_expert, dtype, w)  # each expert's weight
        times[name] = (share * forward, share * backward)
    return times


def _grouped_gemm(hw: HardwareConfig, groups: float, m: float, n: float, k: float, dtype: str, w: Workload) -> float:
    """Seconds of `groups` (m×k)·(k×n) GEMMs in one grouped kernel: one tile shape for every group,
    so each group's last row of tiles runs partly empty, and the waves are counted over all tiles."""
    tables = hw.tables()
    measured = tables.gemm_tflops(m, n, k, dtype) if tables is not None else None
    if measured is not None:  # one group's shape as measured: groups in one kernel run as many
        rate = measured * 1e12
    else:
        filled = m / (math.ceil(m / _TILE[0]) * _TILE[0])
        rate = hw.peak_flops(dtype) * hw.matmul_efficiency * filled * _waves(hw, m, n, groups)
    element = DTYPE_BYTES[w.param_dtype]
    traffic = groups * ((m * k + k * n) * element + m * n * element)
    return max(2 * groups * m * n * k / rate, traffic / hw.memory_bytes_per_second())


def recomputed_by_op_ac(names: list[str]) -> list[str]:
    """What selective "op" checkpointing recomputes: torchtitan's policy saves every other matmul's
    output counting from the first (parallel/activation_checkpoint.py), so the others run again."""
    return names[1::2]


def _linear(hw: HardwareConfig, w: Workload, tokens: float, fan_in: float, fan_out: float) -> tuple[float, float]:
    """(forward, backward) seconds of one linear over `tokens` rows, float8 casts included."""
    dtype = "float8" if w.float8 else w.param_dtype
    forward = _gemm(hw, tokens, fan_out, fan_in, dtype, w)
    # Backward: the input's gradient (tokens × in) and the weight's (in × out, summed over tokens).
    backward = _gemm(hw, tokens, fan_in, fan_out, dtype, w) + _gemm(hw, fan_in, fan_out, tokens, dtype, w)
    if w.float8:
        bandwidth = hw.memory_bytes_per_second()
        cast = _CAST_BYTES[w.compiled] / bandwidth
        weight = fan_in * fan_out / (w.fsdp_shards if w.float8_all_gather else 1)  # cast before the gather
        forward += (tokens * fan_in + weight) * cast
        if not w.compiled:
            # The output's gradient cast twice (one per backward GEMM); the input and, unless it came
            # gathered in float8, the weight cast again; each made column-major for one GEMM.
            again = tokens * fan_out + tokens * fan_in + (0 if w.float8_all_gather else fan_in * fan_out)
            relayout = (tokens * fan_out + tokens * fan_in + fan_in * fan_out) * _LAYOUT_BYTES / bandwidth
            return forward, backward + (tokens * fan_out + again) * cast + relayout
        # The output's gradient cast, and the float8 copies the backward GEMMs read along the other
        # axis: tensorwise transposes its float8 data (a byte read and written), the others cast again
        # (a re-cast reads the saved high-precision tensor: no producer to fuse into).
        transposed = (_LAYOUT_BYTES if w.quantize == "tensorwise" else _LAYOUT_BYTES + 1) / bandwidth
        backward += tokens * fan_out * cast + (tokens * fan_in + fan_in * fan_out) * transposed
    return forward, backward


def _elementwise_bytes(w: Workload) -> float:
    """Bytes one token's forward through a block reads and writes outside matmuls and attention,
    on one rank (sequence parallel under TP: everything is split over tp). Attention's pointwise
    widths are the family's (ModelConfig.attention_pointwise_widths: q's heads need not span dim)."""
    m, tp, a = w.model, w.parallelism.tensor_parallel_degree, DTYPE_BYTES[w.param_dtype]
    dim, ffn = m.dim, m.active_ffn_hidden_dim
    attention = m.attention_pointwise_widths()
    if w.compiled:
        # Fused regions: residual + norm (read 2, write 2) twice; rotary on q and k (with any norm
        # before it); attention's copies before its kernel (K/V repeated to every head); its
        # output made contiguous; SwiGLU (read 2, write 1).
        elements = 8 * dim + 2 * attention.rotary + attention.copied + 2 * attention.output + 3 * ffn
        return elements * a / tp
    # Eager: each RMSNorm ~20 bytes an element (upcast, square, mean, scale, cast back, weight),
    # the block's two and any inside attention (Qwen3's q and k norms); rotary 20 (float32 complex
    # multiply and casts); attention's copies (repeat_interleave of K and V); the output's
    # contiguous copy; two residual adds (read 2, write 1); silu then multiply (read 3, write 2).
    norms = 20 * (2 * dim + attention.inner_norms)
    copies = (attention.copied + 2 * attention.output) * a
    return (norms + 20 * attention.rotary + copies + 2 * 3 * dim * a + SWIGLU_EAGER_ELEMENTS * ffn * a) / tp


def _gradient_sums_bytes(w: Workload) -> float:
    """Bytes per token backward adds beside the forward's pointwise work: autograd sums the input
    gradients of the linears that read one tensor into one. Attention's that read the block's
    normed input, and a dense layer's w1 and w3, over the whole input: under TP each rank sums its
    partial gradients of the gathered sequence before their reduce-scatter, so tp does not divide
    them. A MoE layer's router, routed experts and any shared experts read its normed input, and
    each routed row is read by the experts' w1 and w3: on the rows the rank routes (its sequence
    slice, or every tp rank's where TP splits the experts; the busiest EP rank's). Eager, each add
    is a kernel of its own (read 2, write 1); compiled, inductor fuses the sums into the pointwise
    kernel that reads them next (the norm's backward, or the reduce-scatter's input copy), which
    then reads one more tensor per add. Averaged over the layers."""
    m, p = w.model, w.parallelism
    readers = sum(1 for linear in m.attention_linears().values() if linear.split != "row" and linear.fan_in == m.dim)
    moe_share = m.num_moe_layers / m.n_layers
    adds = (readers - 1) + (1 - moe_share)
    if m.moe.enabled:
        moe = m.moe
        routed = moe.top_k * w.busiest_rank_rows + (1 + 2 * (moe.num_shared_experts > 0))
        adds += moe_share * routed * w.experts_tp / p.tensor_parallel_degree
    return (1 if w.compiled else 3) * adds * m.dim * DTYPE_BYTES[w.param_dtype]


def _routing_bytes(w: Workload) -> tuple[float, float]:
    """(forward, backward) bytes a MoE layer's routing moves per token beside its matmuls and the
    experts' activation, averaged over the layers: the copies of routed rows that
    models/common/moe/ makes on the grouped-GEMM path (tests/unit/test_unit_moe_traffic.py counts
    the same on the layer's aten ops), in elements of a routed row, each pass a read or a write.
    The rank's own rows (its sequence slice's top_k, every tp rank's where TP splits the experts):
    forward, each gathered from its token (2) and back into token order (2), then each token's
    top_k weighed and summed by one batched matmul (1, and its sum 1 per top_k rows); backward,
    the matmul's two gradients (2, and 2 per top_k), the inverse permutation's gradient scattered
    into zeros (the zeros, the rows, the target read and written: 4), the token gather's (the rows
    read, each token's zeros, read and write once per top_k rows: CUDA's sorted accumulation).
    The rows the rank's experts run (the busiest EP rank's, stretched by the load imbalance):
    forward, the grouped GEMM's padded buffer zeroed and the rows written into it (3), the outputs
    gathered out of it (2); backward, that gather's gradient scattered (4), the rows' gathered
    back (2); under EP, regrouped by local expert and back (4, and 8 backward); with expert
    biases (GPT-OSS), each padded row's bias gathered and added after each GEMM (forward 5 + 10
    hidden/dim, backward 1 + 2 hidden/dim, their gradients read into the bias's). Compiled,
    inductor writes each gather into the kernel beside it (the rows into expert order, and back
    weighed: read, write each way) and the bias adds into the activation's kernel."""
    m, p = w.model, w.parallelism
    if not m.moe.enabled:
        return 0.0, 0.0
    moe = m.moe
    k = moe.top_k
    if w.compiled:
        own, received = (2.0, 4.0), (2.0, 4.0)
    else:
        own, received = (5 + 1 / k, 7 + 5 / k), (5.0, 6.0)
        if moe.bias:
            hidden = moe.hidden_dim / w.experts_tp / m.dim
            received = (received[0] + 5 + 10 * hidden, received[1] + 1 + 2 * hidden)
    if p.expert_parallel_degree > 1:
        received = (received[0] + 4, received[1] + 8)
    rows = k * w.experts_tp / p.tensor_parallel_degree * m.num_moe_layers / m.n_layers
    element = m.dim * DTYPE_BYTES[w.param_dtype]
    imbalance = w.busiest_rank_rows
    forward = own[0] + imbalance * received[0]
    backward = own[1] + imbalance * received[1]
    return rows * element * forward, rows * element * backward


def attention_kernel(w: Workload) -> str:
    """The kernel a block's attention runs on a GPU: the family's (ModelConfig.cuda_attention_kernel:
    flash, memory-efficient or FlexAttention), or in float32, which none of them takes, the math
    path."""
    if w.param_dtype == "float32":
        return "math"
    return w.model.cuda_attention_kernel(document_mask=w.masked_keys is not None)


def _attention(hw: HardwareConfig, w: Workload) -> tuple[float, float]:
    """(forward, backward) seconds of causal attention over the microbatch on this rank: its
    queries against the keys each attends to (half the window's score matrix, causal; within its
    document under a document mask, estimate/documents.py), at the kernel's rate."""
    m, p = w.model, w.parallelism
    heads = m.n_heads / p.tensor_parallel_degree
    forward_flops = 4 * w.tokens * w.keys_per_query * heads * m.attention_flops_dim
    kernel = attention_kernel(w)
    if kernel == "math":  # matmuls at the float32 peak
        rate = hw.peak_flops("float32") * hw.matmul_efficiency
    else:
        rate = hw.peak_flops(w.param_dtype) * hw.attention_efficiency
    forward = forward_flops / rate
    backward = forward * _ATTENTION_BACKWARD_FLOPS / _ATTENTION_BACKWARD_EFFICIENCY
    forward_rate, backward_rate = _AGAINST_FLASH[kernel]
    return forward / forward_rate, backward / backward_rate


def block_seconds(hw: HardwareConfig, w: Workload) -> dict[str, float]:
    """One block's forward, backward and recomputation for one microbatch on one rank, seconds."""
    tokens = w.tokens
    linears = {
        name: _linear(hw, w, tokens, *shape) for name, shape in linear_shapes(w).items() if shape[1] and shape[0]
    }
    for name, (forward, backward) in _routed_experts(hw, w).items():
        dense = linears.get(name, (0.0, 0.0))
        linears[name] = (dense[0] + forward, dense[1] + backward)
    bandwidth = hw.memory_bytes_per_second()
    elementwise = tokens * _elementwise_bytes(w) / bandwidth
    routing_forward, routing_backward = (tokens * moved / bandwidth for moved in _routing_bytes(w))
    attention = _attention(hw, w)
    forward = sum(f for f, _ in linears.values()) + attention[0] + elementwise + routing_forward
    backward = sum(b for _, b in linears.values()) + attention[1] + BACKWARD_TRAFFIC * elementwise + routing_backward
    backward += tokens * _gradient_sums_bytes(w) / bandwidth
    ac = w.ac
    if ac.mode == "full":
        recompute = forward
    elif ac.mode == "selective" and ac.selective_ac_option == "op":
        recompute = sum(linears[name][0] for name in recomputed_by_op_ac(list(linears))) + elementwise + routing_forward
    elif ac.mode == "selective":  # every N-th block checkpointed in full
        recompute = forward / int(ac.selective_ac_option)
    else:
        recompute = 0.0
    return {"forward": forward, "backward": backward, "recompute": recompute}


def head_seconds(hw: HardwareConfig, w: Workload) -> float:
    """The output projection (left in high precision, as torchtitan's float8 filter does) forward and
    backward, and cross-entropy, bandwidth-bound."""
    m, tp, tokens = w.model, w.parallelism.tensor_parallel_degree, w.tokens
    high = dataclasses.replace(w, quantize="none")
    forward, backward = _linear(hw, high, tokens, m.dim, m.vocab_size / tp)
    # Eager: the float32 copy, log-softmax, its gradient, the cast back (~28 bytes a logit); compiled:
    # the logits read in forward and backward and their gradient written, in the param dtype.
    per_logit = 3 * DTYPE_BYTES[w.param_dtype] if w.compiled_loss else 28
    loss = tokens * m.vocab_size / tp * per_logit / hw.memory_bytes_per_second()
    return forward + backward + loss


def gpu_compute(w: Workload, hw: HardwareConfig) -> ComputeTimes:
    """Per microbatch: a block (forward + backward + recomputation), the head; the optimizer step."""
    block = block_seconds(hw, w)
    optimizer = (_OPTIMIZER_BYTES[w.optimizer] + _CLIP_BYTES) * local_parameters(w) / hw.memory_bytes_per_second()
    return ComputeTimes(layer=sum(block.values()), head=head_seconds(hw, w), optimizer=optimizer, imbalanced=True)

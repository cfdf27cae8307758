"""What a token keeps in a layer's feed-forward for its backward, per kind of layer (a SwiGLU, or a
MoE layer's routed and shared experts and the rows routing moves), for the memory model
(estimate/memory.py's `layer_activations`)."""

from titan_exp.estimate.workload import DTYPE_BYTES, Workload
from titan_exp.models.common.moe.config import SWIGLU_KEPT
from titan_exp.models.config import ModelConfig


def ffn_kept(m: ModelConfig) -> float:
    """The ffn-wide tensors a token keeps: a SwiGLU's per hidden channel; a MoE layer's routed
    experts' rows their activation's own (MoEConfig.activation_kept), its shared experts a SwiGLU's."""
    if not m.moe.enabled:
        return SWIGLU_KEPT * m.ffn_hidden_dim
    moe = m.moe
    return (moe.activation_kept * moe.top_k + SWIGLU_KEPT * moe.num_shared_experts) * moe.hidden_dim


def routed_rows(w: Workload) -> float:
    """What a MoE layer keeps beyond its experts' SwiGLUs, per token and averaged over the layers:
    the router's float32 scores and chosen weights and the chosen experts (int64); then per token
    whose rows the rank runs, its top_k rows as the experts read them and their outputs back in
    token order (the batched matmul that weighs and sums them reads them), and the int64 indices
    that move them (source tokens and the way back; under EP also the received rows' order and its
    way back). The busiest EP rank runs `busiest_rank_rows` times the mean rank's rows."""
    m = w.model
    if not m.moe.enabled:
        return 0.0
    moe, act = m.moe, DTYPE_BYTES[w.param_dtype]
    ep = w.parallelism.expert_parallel_degree > 1
    routed_here = (moe.num_experts + 2 * moe.top_k) * 4 / act + moe.top_k * 8 / act
    rows = 2 * moe.top_k * m.dim + (4 if ep else 2) * moe.top_k * 8 / act
    rows += (w.busiest_rank_rows - 1) * moe.top_k * (m.dim + moe.activation_kept * moe.hidden_dim)
    if w.experts_tp > 1:
        # Every tp rank's tokens, gathered (kept once more), and their rows: tp times a slice's
        # (the caller divides by tp).
        rows = (rows + m.dim) * w.experts_tp
    return m.num_moe_layers / m.n_layers * (routed_here + rows)

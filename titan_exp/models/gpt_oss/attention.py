"""GPT-OSS's attention: grouped-query attention whose projections carry biases, whose softmax of
each head runs over one more logit, the head's learned sink (it takes a share of the attention and
gives back no value), and whose layers 0, 2, 4, ... see only the last `sliding_window` keys.

On CPUs the scores are computed whole (SDPA takes no sink); on CUDA FlexAttention computes only the
blocks the mask leaves and returns the log-sum-exp of each query's scores, from which the sink's
share follows: out · σ(lse − sink) (softmax over [scores, sink] = softmax(scores) · Z / (Z + e^sink))."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan_exp.models.common.attention import GroupedQueryAttention
from titan_exp.models.common.rotary import compiled_once
from titan_exp.models.gpt_oss.config import GptOssConfig
from titan_exp.parallel.tensor_parallel import TensorParallel


class SinkAttention(GroupedQueryAttention):
    def __init__(self, cfg: GptOssConfig, layer: int):
        super().__init__(cfg, bias=True)
        self.sinks = nn.Parameter(torch.empty(cfg.n_heads))
        self.window = cfg.sliding_window if cfg.is_sliding_layer(layer) else None
        self.scale = cfg.head_dim**-0.5 * cfg.attention_scale_factor
        self.attend = self._attend_with_sinks

    def _attend_with_sinks(self, q, k, v, documents: torch.Tensor | None = None) -> torch.Tensor:
        sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks  # this rank's heads'
        return sink_attention(q, k, v, sinks, self.scale, self.window, documents)

    def tensor_parallel_plan(self, tp: TensorParallel) -> dict:
        """Grouped-query attention's split, the biases with their linears (column-wise sharded,
        row-wise added once after the sum), the sinks with the heads."""
        self.sinks = nn.Parameter(distribute_tensor(self.sinks, tp.mesh, [Shard(0)], src_data_rank=None))
        return super().tensor_parallel_plan(tp)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    window: int | None,
    documents: torch.Tensor | None,
) -> torch.Tensor:
    """q (batch, seq, heads, head_dim), k and v with the kv heads; each query attends causally to
    the keys of its document (where `documents` is given), the last `window` of them (where given),
    and to its head's sink. Returns (batch, seq, heads, head_dim)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if q.is_cuda:
        out = _flex_sink_attention(q, k, v, sinks, scale, flex_visible(window, documents))
    else:
        out = _dense_sink_attention(q, k, v, sinks, scale, _mask(q.shape[2], window, documents, q.device))
    return out.transpose(1, 2)


def _mask(seq: int, window: int | None, documents: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Which keys (columns) each query (row) sees: (seq, seq), or (batch, 1, seq, seq) with documents."""
    position = torch.arange(seq, device=device)
    offset = position.unsqueeze(1) - position.unsqueeze(0)  # query − key
    mask = offset >= 0 if window is None else (offset >= 0) & (offset < window)
    if documents is None:
        return mask
    return (mask & (documents.unsqueeze(2) == documents.unsqueeze(1))).unsqueeze(1)


def _dense_sink_attention(q, k, v, sinks, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """Every score, in float32 (transformers' eager attention, the reference of GPT-OSS's)."""
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scores = (q @ k.transpose(-2, -1)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def _flex_sink_attention(q, k, v, sinks, scale: float, visible, compiled: bool = True) -> torch.Tensor:
    """FlexAttention over the blocks the mask `visible` leaves, the sink applied through the
    log-sum-exp (`compiled`: its generated kernels; uncompiled it runs a dense reference)."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    batch, _, seq, _ = q.shape
    mask = create_block_mask(visible, batch, None, seq, seq, device=q.device)
    attend = compiled_once(flex_attention) if compiled else flex_attention
    out, aux = attend(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out * torch.sigmoid(aux.lse - sinks.view(1, -1, 1)).unsqueeze(-1).to(out.dtype)


def flex_visible(window: int | None, documents: torch.Tensor | None):
    """FlexAttention's mask function of `_mask`: causal, within the window and the document."""

    def visible(batch, head, query, key):
        keep = key <= query
        if window is not None:
            keep = keep & (query - key < window)
        if documents is not None:
            keep = keep & (documents[batch, query] == documents[batch, key])
        return keep

    return visible

"""Rotary position embeddings (Meta's interleaved channel pairs) with Llama 3.1's or YaRN's
frequency scaling, and causal attention over a whole sequence: what every attention here shares."""

import functools
import math

import torch
import torch.nn.functional as F

from titan_exp.models.config import ModelConfig


def precompute_freqs_cis(cfg: ModelConfig, seq_len: int) -> torch.Tensor:
    """Complex rotations e^{i·pos·freq}, shape (seq_len, rope_dim/2)."""
    dim = cfg.rope_dim
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32)[: dim // 2] / dim))
    if cfg.rope_scaling_factor is not None:
        scale = _scale_llama31_freqs if cfg.rope_scaling_type == "llama3" else _scale_yarn_freqs
        freqs = scale(freqs, cfg)
    positions = torch.arange(seq_len, dtype=torch.float32)
    return torch.polar(torch.ones(seq_len, dim // 2), torch.outer(positions, freqs))


def _scale_llama31_freqs(freqs: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    # Long wavelengths are slowed by the factor, short ones kept, the band between interpolated.
    low_freq_wavelen = cfg.rope_original_max_seq_len / cfg.rope_low_freq_factor
    high_freq_wavelen = cfg.rope_original_max_seq_len / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (cfg.rope_original_max_seq_len / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    interpolated = (1 - smooth) * freqs / cfg.rope_scaling_factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / cfg.rope_scaling_factor, interpolated)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def _scale_yarn_freqs(freqs: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """YaRN's "NTK-by-parts" (DeepSeek-V3's, as torchtitan and transformers apply it at every
    length): dimensions that turn fewer than beta_slow times over the original context are slowed
    by the factor, those that turn more than beta_fast times kept, a linear ramp between."""
    dim, original = cfg.rope_dim, cfg.rope_original_max_seq_len

    def dimension_turning(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = dimension_turning(cfg.rope_beta_fast), dimension_turning(cfg.rope_beta_slow)
    if cfg.rope_yarn_truncate:  # the ramp's ends on whole dimensions (GPT-OSS's YaRN leaves them as they fall)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return freqs / cfg.rope_scaling_factor * ramp + freqs * (1 - ramp)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) pairs of channels by position."""
    x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = x_complex * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal attention over one whole sequence: q (batch, seq, heads, head_dim), k and v with the kv
    heads (grouped-query attention: each repeated for its group of query heads). `documents`
    (batch, seq): each token's document in its window, whose tokens alone it attends to (a block
    mask: SDPA's boolean mask here, FlexAttention's block-sparse one on CUDA)."""
    repeats = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(repeats, dim=2)
    v = v.repeat_interleave(repeats, dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if documents is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif q.is_cuda:
        out = _flex_document_attention(q, k, v, documents)
    else:
        same = documents.unsqueeze(2) == documents.unsqueeze(1)
        mask = same & torch.ones_like(same[0], dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
    return out.transpose(1, 2)


def attend(attention, q, k, v, documents: torch.Tensor | None) -> torch.Tensor:
    """`attention(q, k, v)`, within documents where given (context parallelism's own attention,
    which takes no documents, is refused with them: config/check.py)."""
    return attention(q, k, v) if documents is None else attention(q, k, v, documents)


def document_ids(tokens: torch.Tensor, document_end: int) -> torch.Tensor:
    """Each token's document in its window (batch, seq): a document ends with its `document_end`
    token, and the next one begins after it."""
    ends = (tokens == document_end).to(torch.int32)
    return ends.cumsum(dim=1) - ends


def _flex_document_attention(q, k, v, documents: torch.Tensor) -> torch.Tensor:
    """FlexAttention with a block mask of the documents: the blocks no query of a block attends to
    are skipped, so the work falls with the documents' lengths (CUDA; SDPA's dense mask elsewhere)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def same_document_causal(batch, head, query, key):
        return (key <= query) & (documents[batch, query] == documents[batch, key])

    batch, _, seq, _ = q.shape
    mask = create_block_mask(same_document_causal, batch, None, seq, seq, device=q.device)
    return compiled_once(flex_attention)(q, k, v, block_mask=mask)


@functools.cache
def compiled_once(function):
    """FlexAttention's kernels are generated by torch.compile (uncompiled it runs a dense reference)."""
    return torch.compile(function)

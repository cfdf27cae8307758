"""Rotary position embeddings (Meta's interleaved channel pairs) with Llama 3.1's or YaRN's
frequency scaling, and causal attention over a whole sequence: what every attention here shares."""

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

    low = max(math.floor(dimension_turning(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(dimension_turning(cfg.rope_beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return freqs / cfg.rope_scaling_factor * ramp + freqs * (1 - ramp)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) pairs of channels by position."""
    x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = x_complex * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over one whole sequence: q (batch, seq, heads, head_dim), k and v with the kv
    heads (grouped-query attention: each repeated for its group of query heads)."""
    repeats = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(repeats, dim=2)
    v = v.repeat_interleave(repeats, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)

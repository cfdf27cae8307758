"""Llama 3 model hyper-parameters: the `model` config group is read into this."""

from dataclasses import dataclass
from typing import Optional

from titan_exp.rules import Section


@dataclass
class Llama3Config(Section):
    name: str = "llama3"
    flavor: str = "debug"
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    # None means multi-head attention (as many kv heads as heads).
    n_kv_heads: Optional[int] = 4
    vocab_size: int = 2048
    # SwiGLU hidden size = multiple_of-rounded(ffn_dim_multiplier * 8/3 * dim), as in Meta's reference code.
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1-style frequency scaling; None disables it.
    rope_scaling_factor: Optional[float] = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 2048
    tie_word_embeddings: bool = False

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

"""Model FLOPs per token, torchtitan's formula (so MFU numbers are comparable)."""

from titan_exp.models.llama3.args import Llama3Config


def flops_per_token(cfg: Llama3Config, num_params: int, num_embedding_params: int, seq_len: int) -> int:
    """6·(N − N_embedding) for the dense matmuls (forward + backward) plus 12·L·H·Q·T for attention.
    A tied embedding (counted once in N) is the output projection's matrix too, whose matmul runs:
    it stays in (torchtitan 0.3.0's count)."""
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    matmul_params = num_params if cfg.tie_word_embeddings else num_params - num_embedding_params
    return 6 * matmul_params + attention

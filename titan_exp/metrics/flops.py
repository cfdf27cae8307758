"""Model FLOPs per token, torchtitan's formula (so MFU numbers are comparable)."""

from titan_exp.estimate.workload import inactive_parameters
from titan_exp.models.config import ModelConfig


def flops_per_token(cfg: ModelConfig, num_params: int, num_embedding_params: int, seq_len: int) -> int:
    """6·(N − N_embedding) for the dense matmuls (forward + backward) plus 12·L·H·Q·T for attention.
    A tied embedding (counted once in N) is the output projection's matrix too, whose matmul runs:
    it stays in (torchtitan 0.3.0's count). N counts the experts a token is routed to, not all of them."""
    attention = int(12 * cfg.n_layers * cfg.n_heads * cfg.attention_flops_dim * seq_len)
    matmul_params = num_params if cfg.tie_word_embeddings else num_params - num_embedding_params
    # A MoE token runs through its top-k experts only: the active parameters (torchtitan's count).
    return 6 * (matmul_params - inactive_parameters(cfg)) + attention

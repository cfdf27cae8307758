"""Grouped-query attention (Llama 3's, Qwen3's with an RMSNorm over each head's q and k before the
rotary embedding, GPT-OSS's with biases and its own `attend`), and how tensor parallelism splits it."""

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from titan_exp.models.common.rotary import apply_rotary_emb, attend, causal_attention
from titan_exp.models.config import ModelConfig
from titan_exp.parallel.tensor_parallel import TensorParallel, replicated_on_local_tensors


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool = False, bias: bool = False):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        # q, k, v -> output, all (batch, seq, heads, head_dim); context parallelism swaps in its own.
        self.attend = causal_attention
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 instead of the head count: under tensor parallel each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        return self.wo(attend(self.attend, q, k, v, documents).reshape(batch, seq, -1))

    def tensor_parallel_plan(self, tp: TensorParallel) -> dict:
        """Megatron's split (torchtitan's plan): the heads column-wise into q, k and v, row-wise out
        of wo back onto sequence shards; the input gathered from them. The q/k norms, over
        (batch, seq, heads, head_dim), see each rank's own heads."""
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                replicated_on_local_tensors(norm, tp.mesh, Shard(2))
        return {
            "": tp.prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "wq": tp.colwise(),
            "wk": tp.colwise(),
            "wv": tp.colwise(),
            "wo": tp.rowwise(output_layouts=Shard(1)),
        }

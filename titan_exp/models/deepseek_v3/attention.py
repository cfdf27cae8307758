"""Multi-head latent attention (DeepSeek-V3): keys and values are rebuilt per head from one
compressed latent (and queries from another, where q_lora_rank is set); each head's query and key
carry a rotary part, the key's shared by every head, and a part without position."""

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from titan_exp.models.common.rotary import apply_rotary_emb, attend, causal_attention
from titan_exp.models.deepseek_v3.config import DeepSeekV3Config
from titan_exp.parallel.tensor_parallel import TensorParallel, replicated_on_local_tensors


class LatentAttention(nn.Module):
    def __init__(self, cfg: DeepSeekV3Config):
        super().__init__()
        mla = cfg.mla
        self.mla = mla
        # q, k, v -> output, all (batch, seq, heads, head_dim); context parallelism swaps in its own.
        self.attend = causal_attention
        heads = cfg.n_heads
        if mla.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, mla.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(mla.q_lora_rank, eps=cfg.norm_eps)
            self.wq_b = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, heads * mla.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(mla.kv_lora_rank, eps=cfg.norm_eps)
        self.wkv_b = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * mla.v_head_dim, cfg.dim, bias=False)
        # Under tensor parallel (tensor_parallel_plan): the tp ranks, each holding some of the heads. The
        # latent projections stay whole on every rank; the rotary key they share gets its gradient
        # summed over the ranks' heads (the latents get theirs through wkv_b's and wq_b's inputs).
        self.tp_group: dist.ProcessGroup | None = None
        # The attention's scale relative to SDPA's own 1/√(qk head dim): YaRN's mscale², folded into q.
        self.q_scale = 1.0
        if cfg.rope_scaling_type == "yarn" and cfg.rope_scaling_factor:
            self.q_scale = (0.1 * mla.mscale * math.log(cfg.rope_scaling_factor) + 1.0) ** 2

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        mla = self.mla
        q = self.wq_b(self.q_norm(self.wq_a(x))) if mla.q_lora_rank else self.wq(x)
        q = q.view(batch, seq, -1, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        q_rope = apply_rotary_emb(q_rope, freqs_cis)
        if self.tp_group is not None:
            k_rope = _SumGradients.apply(k_rope, self.tp_group)
        k_rope = apply_rotary_emb(k_rope.unsqueeze(2), freqs_cis)  # one rotary key for every head
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1) * self.q_scale
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return self.wo(attend(self.attend, q, k, v, documents).reshape(batch, seq, -1))

    def tensor_parallel_plan(self, tp: TensorParallel) -> dict:
        """torchtitan's split: the heads' up-projections (wq or wq_b, wkv_b) column-wise and wo
        row-wise, as a Llama block's; the down-projections to the latents and their norms whole on
        every rank, on the gathered sequence (their gradients arrive summed over the ranks' heads,
        through the column-wise inputs and the rotary key's sum)."""
        self.tp_group = tp.mesh.get_group()
        whole = [self.wkv_a, self.kv_norm]
        if self.mla.q_lora_rank:
            whole += [self.wq_a, self.q_norm]
        for module in whole:
            replicated_on_local_tensors(module, tp.mesh, Replicate())
        return {
            "": PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
            ),
            "wq_b" if self.mla.q_lora_rank else "wq": ColwiseParallel(),
            "wkv_b": ColwiseParallel(),
            "wo": RowwiseParallel(output_layouts=Shard(1)),
        }


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward, the gradient summed over `group` (whose ranks each used the
    tensor for their own heads)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None

"""The baseline: a minimal, plain-PyTorch Llama 3 training loop, written independently of titan_exp.

Same architecture and shapes as titan_exp's llama3_debug (RMSNorm, RoPE, GQA, SwiGLU), AdamW, random
tokens, fp32. Runs on one process, or under torchrun with DDP over gloo (--fsdp: FSDP2's fully_shard
per block and at the root, its default collectives). Prints one line per step:
`step N loss X time T` with T the wall-clock seconds since the process started (time.time()).
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        # Separate projections, as in Meta's reference code (and titan_exp): same matmuls, same shapes.
        self.q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(b, t, -1, self.head_dim) for proj in (self.q, self.k, self.v))
        q, k = (
            torch.view_as_real(
                torch.view_as_complex(z.float().reshape(b, t, z.shape[2], -1, 2)) * rope[:t, None]
            ).flatten(3)
            for z in (q, k)
        )
        k, v = (z.repeat_interleave(self.heads // self.kv_heads, 2) for z in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int, max_len: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm, self.out = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        freqs = 1.0 / 500000.0 ** (torch.arange(0, dim // heads, 2).float() / (dim // heads))
        self.register_buffer(
            "rope", torch.polar(torch.ones(max_len, len(freqs)), torch.outer(torch.arange(max_len).float(), freqs))
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, self.rope)
        return self.out(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP2 instead of DDP")
    args = parser.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if distributed else 0
    torch.manual_seed(0)
    model = Llama(vocab=2048, dim=256, layers=6, heads=16, kv_heads=4, hidden=768, max_len=2048)
    if distributed and args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(2048, (args.batch, args.seq + 1))
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} time {time.time():.3f}", flush=True)
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

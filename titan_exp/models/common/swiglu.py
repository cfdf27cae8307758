"""The SwiGLU feed-forward, w2(silu(w1·x) ⊙ w3·x): Llama's, Qwen3's dense layers and shared experts."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from titan_exp.parallel.tensor_parallel import TensorParallel


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def tensor_parallel_plan(self, tp: TensorParallel) -> dict:
        """The hidden columns split: w1 and w3 column-wise on the gathered input, w2 row-wise back
        onto sequence shards."""
        return {
            "": tp.prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "w1": tp.colwise(),
            "w2": tp.rowwise(output_layouts=Shard(1)),
            "w3": tp.colwise(),
        }

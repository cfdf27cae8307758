"""Tensor parallel inside the experts (parallelism.expert_tensor_parallel_degree = tp, or TP
without expert parallelism): each expert's hidden dim split over the tp ranks, as a dense SwiGLU's
is under TP, so every tp rank must run the same tokens.

Each tp rank routes its own slice of the sequence (the router's load, auxiliary loss and gradient
as without this split); the slices' tokens and their routing are then all-gathered, each rank's
expert shards give a partial sum of every token's output, and a reduce-scatter sums them and hands
each rank its slice back. Backward mirrors it: the gradients of the gathered tokens are partial sums
(each rank's hidden shard's), reduce-scattered onto the slices."""

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


class ExpertTensorParallel:
    def __init__(self, tp_mesh: DeviceMesh):
        self.mesh = tp_mesh

    def gather(
        self, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> tuple[DTensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every tp rank's (tokens, routing weights, chosen experts), rows in rank order. Returns
        the tokens as a DTensor (the shared experts' input under TP) and local, then the weights and
        the experts local; the local tensors' gradients are taken as partial sums."""
        gathered = self._all_gather(tokens)
        partial = [Partial()]
        local_tokens = gathered.to_local(grad_placements=partial)
        local_weights = self._all_gather(weights).to_local(grad_placements=partial)
        return gathered, local_tokens, local_weights, self._all_gather(experts).to_local()

    def reduce(self, routed: torch.Tensor, shared: DTensor | None) -> torch.Tensor:
        """This rank's slice of the sum over the tp ranks of the routed experts' partial outputs
        (local, every gathered row) and the shared experts' (a partial DTensor, or None)."""
        out = DTensor.from_local(routed, self.mesh, [Partial()], run_check=False)
        if shared is not None:
            out = out + shared
        return out.redistribute(self.mesh, [Shard(0)]).to_local()

    def _all_gather(self, rows: torch.Tensor) -> DTensor:
        sliced = DTensor.from_local(rows, self.mesh, [Shard(0)], run_check=False)
        return sliced.redistribute(self.mesh, [Replicate()])

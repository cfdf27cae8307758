"""Gradient clipping by the total norm over all parameters, sharded (DTensor) or not."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip in place and return the total norm before clipping.

    Under FSDP/TP each rank holds shards of the gradients: the norm of a DTensor gradient is computed
    over the full tensor (a reduction across the mesh); under pipeline parallelism each pp rank holds
    other layers, so the squared norms are summed over the pp group. Every rank then clips by the same
    global norm.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    if pp_group is not None:
        squared = total_norm**2
        dist.all_reduce(squared, group=pp_group)
        total_norm = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=True)
    return total_norm

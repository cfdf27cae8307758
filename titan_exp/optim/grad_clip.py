"""Gradient clipping by the total norm over all parameters, sharded (DTensor) or not."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip in place and return the total norm before clipping.

    Under FSDP/TP each rank holds shards of the gradients: the norm of DTensor gradients is computed
    over the full tensors (a reduction across their mesh), one mesh at a time, as expert-parallel
    experts live on another mesh than the dense parameters; under pipeline parallelism each pp rank
    holds other layers, so the squared norms are summed over the pp group. Every rank then clips by
    the same global norm.
    """
    # Parameters by the mesh of their gradient (None: not sharded); foreach ops take one mesh at a time.
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:  # no gradient on this rank
        total_norm = torch.zeros(())
    else:  # one mesh's norm as it is (the usual case: no round-off added)
        total_norm = norms[0] if len(norms) == 1 else torch.stack(norms).norm()
    if pp_group is not None:
        squared = total_norm**2
        dist.all_reduce(squared, group=pp_group)
        total_norm = squared.sqrt()
    if max_norm > 0:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach=True)
    return total_norm

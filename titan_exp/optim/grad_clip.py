"""Gradient clipping by the total norm over all parameters, sharded (DTensor) or not, and the
partial-sum gradients summed once before it."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


@torch.no_grad()
def reduce_partial_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """Sum the gradients DTensor leaves as partial sums (weights TP replicates: the norms under
    sequence parallelism, the MoE router, per-head q/k norms), one all-reduce per mesh, placements
    and dtype, and store them replicated. Left partial, each optimizer op and the norm that reads one
    would sum it again (an all-reduce apiece). FSDP sums its own before the reduce-scatter."""
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in parameters:
        grad = p.grad
        if isinstance(grad, DTensor) and Partial() in grad.placements:
            groups.setdefault((grad.device_mesh, grad.placements, grad.dtype), []).append(p)
    for (mesh, placements, _), params in groups.items():
        pieces = [p.grad.to_local() for p in params]
        flat = torch.cat([piece.reshape(-1) for piece in pieces])
        for dim, placement in enumerate(placements):
            if placement == Partial():
                dist.all_reduce(flat, group=mesh.get_group(dim))
        summed = tuple(Replicate() if placement == Partial() else placement for placement in placements)
        for p, piece, total in zip(params, pieces, flat.split([piece.numel() for piece in pieces])):
            p.grad = DTensor.from_local(
                total.view_as(piece), mesh, summed, run_check=False, shape=p.grad.shape, stride=p.grad.stride()
            )


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

"""FSDP2's all-gather and reduce-scatter as point-to-point sends on gloo (parallel/gloo_comms.py), on
real gloo ranks, against gloo's own collectives: the same numbers (exactly on two ranks, where a sum
of two terms has one order), over a sub-group too, gloo's own for an op they do not do, the
all-gather's asynchronous form, and the reduce-scatter finished later inside a real backward pass."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launchers.rendezvous import free_port
from titan_exp.parallel.gloo_comms import PeerAllGather, PeerReduceScatter

NUMEL = 3 * 4 * 1000 + 12  # divisible by 2, 3 and 4 ranks


def _init(rank: int, world: int, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _against_gloo(rank: int, world: int, results: dict) -> None:
    # A group of the odd-numbered ranks exercises local-to-global rank mapping (world 4: ranks 1, 3).
    groups = [dist.group.WORLD]
    if world == 4:
        odd = dist.new_group([1, 3])
        groups.append(odd if rank % 2 else None)
    for g, group in enumerate(groups):
        if group is None:
            continue
        size = group.size()
        grads = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
        shard = torch.randn(NUMEL // size, generator=torch.Generator().manual_seed(100 + rank))
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
            peer, gloo = torch.empty(NUMEL // size), torch.empty(NUMEL // size)
            PeerReduceScatter()(peer, grads.clone(), group, op)
            dist.reduce_scatter_tensor(gloo, grads.clone(), op=op, group=group)
            results[(rank, g, str(op))] = (peer, gloo)
        peer, gloo = torch.empty(NUMEL), torch.empty(NUMEL)
        PeerAllGather()(peer, shard, group)
        dist.all_gather_into_tensor(gloo, shard, group=group)
        results[(rank, g, "all_gather")] = (peer, gloo)
        # Asynchronous, gathered in place as FSDP2 does (the input is this rank's chunk of the output).
        in_place = torch.empty(NUMEL)
        in_place.view(size, -1)[group.rank()].copy_(shard)
        work = PeerAllGather()(in_place, in_place.view(size, -1)[group.rank()], group, async_op=True)
        assert isinstance(work, dist.Work)
        work.wait()
        results[(rank, g, "all_gather_async")] = (in_place, gloo)


def _ranks(rank: int, world: int, port: int, collectives: dict, deferred: dict) -> None:
    """One world's ranks: the collectives against gloo's, then (on two ranks) the reduce-scatter
    deferred in a backward pass."""
    _init(rank, world, port)
    try:
        _against_gloo(rank, world, collectives)
        if world == 2:
            _deferred_in_backward(rank, world, deferred)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def worlds():
    """Each world's results (collectives, deferred), from one spawn of its ranks, made once."""
    made = {}

    def results(world: int) -> tuple[dict, dict]:
        if world not in made:
            manager = mp.Manager()
            collectives, deferred = manager.dict(), manager.dict()
            mp.spawn(_ranks, args=(world, free_port(), collectives, deferred), nprocs=world)
            made[world] = dict(collectives), dict(deferred)
        return made[world]

    return results


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), 4])
def test_peer_collectives_give_gloos_results(world, worlds):
    results, _ = worlds(world)
    assert len(results) == world * 5 + (2 * 5 if world == 4 else 0)
    for (rank, group, op), (peer, gloo) in results.items():
        if op.startswith("all_gather") or world == 2 or "MAX" in op:
            assert torch.equal(peer, gloo), (rank, group, op)
        else:  # each rank adds in rank order, gloo's all-reduce in its own
            torch.testing.assert_close(peer, gloo, rtol=1e-6, atol=1e-6)


class _ReduceScatterInBackward(torch.autograd.Function):
    """Identity forward; its backward reduce-scatters a tensor into `out`, as FSDP2's post-backward
    hook does for a block's gradients, and records whether `out` was complete at that point."""

    @staticmethod
    def forward(ctx, x, grads, out, reduce_scatter, seen):
        ctx.args = grads, out, reduce_scatter, seen
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grads, out, reduce_scatter, seen = ctx.args
        reduce_scatter(out, grads, dist.group.WORLD, dist.ReduceOp.AVG)
        seen.append(out.clone())
        return grad, None, None, None, None


def _deferred_in_backward(rank: int, world: int, results: dict) -> None:
    reduce_scatter = PeerReduceScatter(defer_in_backward=True)
    grads = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    outs = [torch.full((NUMEL // world,), float("nan")) for _ in grads]
    seen: list[torch.Tensor] = []
    x = torch.ones(4, requires_grad=True)
    y = x
    for g, out in zip(grads, outs):  # backward runs them last to first
        y = _ReduceScatterInBackward.apply(y, g, out, reduce_scatter, seen)
    y.sum().backward()
    expected = []
    for g in grads:
        gloo = torch.empty(NUMEL // world)
        dist.reduce_scatter_tensor(gloo, g.clone(), op=dist.ReduceOp.AVG, group=dist.group.WORLD)
        expected.append(gloo)
    # Outside backward it is not deferred: complete on return.
    now = torch.empty(NUMEL // world)
    reduce_scatter(now, grads[0].clone(), dist.group.WORLD, dist.ReduceOp.AVG)
    results[rank] = (outs, expected, seen, now, x.grad)


def test_reduce_scatter_deferred_in_backward_is_complete_after_it(worlds):
    _, results = worlds(2)
    assert sorted(results) == [0, 1]
    for rank, (outs, expected, seen, now, x_grad) in results.items():
        for out, gloo in zip(outs, expected):
            assert torch.equal(out, gloo), rank
        # Inside backward the output was left to be finished (still NaN when its hook returned).
        assert all(torch.isnan(s).all() for s in seen), rank
        assert torch.equal(now, expected[0]), rank
        assert torch.equal(x_grad, torch.ones(4)), rank

"""FSDP2's all-gather and reduce-scatter as rings of sends on gloo (parallel/gloo_comms.py), on real
gloo ranks, against gloo's own collectives: the same numbers (exactly on two ranks, where a sum of
two terms has one order), over a sub-group too, and gloo's own for an op the ring does not do."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launchers.env import free_port
from titan_exp.parallel.gloo_comms import RingAllGather, RingReduceScatter

NUMEL = 3 * 4 * 1000 + 12  # divisible by 2, 3 and 4 ranks


def _rank(rank: int, world: int, port: int, results: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
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
                ring, gloo = torch.empty(NUMEL // size), torch.empty(NUMEL // size)
                RingReduceScatter()(ring, grads.clone(), group, op)
                dist.reduce_scatter_tensor(gloo, grads.clone(), op=op, group=group)
                results[(rank, g, str(op))] = (ring, gloo)
            ring, gloo = torch.empty(NUMEL), torch.empty(NUMEL)
            RingAllGather()(ring, shard, group)
            dist.all_gather_into_tensor(gloo, shard, group=group)
            results[(rank, g, "all_gather")] = (ring, gloo)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), 4])
def test_ring_collectives_give_gloos_results(world):
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(world, free_port(), results), nprocs=world)
    assert len(results) == world * 4 + (2 * 4 if world == 4 else 0)
    for (rank, group, op), (ring, gloo) in results.items():
        if op == "all_gather" or world == 2 or "MAX" in op:
            assert torch.equal(ring, gloo), (rank, group, op)
        else:  # the ring adds in another order than gloo's all-reduce
            torch.testing.assert_close(ring, gloo, rtol=1e-6, atol=1e-6)

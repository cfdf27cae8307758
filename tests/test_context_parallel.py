"""The all-gather context-parallel attention (parallel/context.py) on real gloo ranks, against the
single-device causal attention on the whole sequence: outputs and the gradients of q, k and v."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launchers.rendezvous import free_port
from titan_exp.models.common.rotary import causal_attention
from titan_exp.parallel.context import AllGatherAttention, load_balanced_positions

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 48, 4, 2, 8


def _whole_sequence() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(BATCH, SEQ, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    grad_out = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    return q, k, v, grad_out


def _rank(rank: int, world: int, port: int, results: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        q, k, v, grad_out = _whole_sequence()
        mine = load_balanced_positions(SEQ, world, rank)
        local = [t[:, mine].clone().requires_grad_() for t in (q, k, v)]
        out = AllGatherAttention(dist.group.WORLD)(*local)
        out.backward(grad_out[:, mine])
        results[rank] = (mine, out.detach(), *(t.grad for t in local))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_attention_matches_whole_sequence_attention(cp):
    q, k, v, grad_out = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_whole_sequence()))
    expected = causal_attention(q, k, v)
    expected.backward(grad_out)
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(cp, free_port(), results), nprocs=cp)
    covered = torch.cat([results[r][0] for r in range(cp)])
    assert sorted(covered.tolist()) == list(range(SEQ))  # every position on exactly one rank
    for rank in range(cp):
        mine, out, dq, dk, dv = results[rank]
        torch.testing.assert_close(out, expected.detach()[:, mine])
        torch.testing.assert_close(dq, q.grad[:, mine])
        # K and V of a position are used by later positions on other ranks: their gradients come back
        # through the reduce-scatter.
        torch.testing.assert_close(dk, k.grad[:, mine])
        torch.testing.assert_close(dv, v.grad[:, mine])


def test_load_balanced_positions_pair_an_early_chunk_with_a_late_one():
    assert load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]

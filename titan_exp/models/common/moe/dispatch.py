"""Expert parallelism's token exchange: each rank holds num_experts / ep experts of every MoE layer,
sends the rows it routed to another rank's experts there, runs its own experts over the rows it
receives, and sends the outputs back, all by all-to-all with uneven splits over the EP group
(torch's all_to_all_single: gloo on CPU ranks, nccl on CUDA).

The rows a rank receives come source rank by source rank, each source's sorted by expert; they are
regrouped by expert with a stable sort, so each expert sees its rows in (source rank, token) order:
the same rows in every layout, in an order that depends only on the ranks' batches."""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

# The profiler's name for the exchanges, forward and backward (profiling/profiler.py sums it).
ALL_TO_ALL_RANGE = "moe/all_to_all"


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty(sum(out_splits), *rows.shape[1:])
        with torch.profiler.record_function(ALL_TO_ALL_RANGE):
            dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def exchange_counts(sent: list[list[int]], group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    """`sent[r][e]`: rows this rank sends to rank r's e-th expert. Returns, for each source rank,
    how many rows it sends to each of this rank's experts."""
    sent_tensor = torch.tensor(sent, device=device)
    received = torch.empty_like(sent_tensor)
    with torch.profiler.record_function(ALL_TO_ALL_RANGE):
        dist.all_to_all_single(received, sent_tensor, group=group)
    return received.tolist()


def run_on_expert_ranks(
    grouped: torch.Tensor,
    counts: list[int],
    group: dist.ProcessGroup,
    local_experts: Callable[[torch.Tensor, list[int]], torch.Tensor],
) -> torch.Tensor:
    """`grouped`: this rank's routed rows sorted by (global) expert, `counts[e]` of them for expert
    e. Returns their outputs in the same order, computed by `local_experts(rows sorted by local
    expert, rows per local expert)` on the ranks that own the experts."""
    fake = is_fake(grouped)
    local = len(counts) // group.size()
    sent = [counts[start : start + local] for start in range(0, len(counts), local)]  # by owning rank
    # A dry run's (fake) ranks are taken to receive what they send (the balanced case).
    received_counts = sent if fake else exchange_counts(sent, group, grouped.device)
    send_splits = [sum(rows) for rows in sent]
    receive_splits = [sum(source) for source in received_counts]
    per_expert = [sum(column) for column in zip(*received_counts)]
    received = _AllToAll.apply(grouped, receive_splits, send_splits, group)
    if fake:  # shapes only: no rows to put in order
        return _AllToAll.apply(local_experts(received, per_expert), send_splits, receive_splits, group)
    # The local expert of each received row, then the rows in local-expert order (stable: by source).
    expert_of_row = torch.arange(local).repeat(group.size()).repeat_interleave(torch.tensor(received_counts).flatten())
    order = expert_of_row.argsort(stable=True).to(grouped.device)
    computed = local_experts(received[order], per_expert)
    # Back to the order the rows arrived in (by the inverse permutation: index_copy would keep
    # `computed` for backward), and to the ranks they came from.
    outputs = computed[order.argsort()]
    return _AllToAll.apply(outputs, send_splits, receive_splits, group)

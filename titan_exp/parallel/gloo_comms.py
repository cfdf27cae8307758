"""FSDP2's collectives for CPU ranks: point-to-point sends over gloo that FSDP2 need not wait for.

gloo's own all-gather and reduce-scatter move the same bytes far slower than its sends do: its
reduce-scatter is a full all-reduce of which each rank keeps one chunk (twice the bytes), and its
all-gather ran at half the speed of the same bytes sent peer to peer (measured on 2 CPU ranks, the
debug model's 22 MB of float32 parameters: all-gather 20 ms against 9 ms; reduce-scatter 29 ms
against 14 ms). Here every rank sends each peer its chunk directly, all sends and receives at once.

On CPU FSDP2 has no side streams, so a collective it waits for is a point where the two ranks
sharing the cores must meet, and the one ahead idles. These collectives need not be waited for:
- the all-gather returns a `dist.Work` when FSDP2 asks for an asynchronous unshard
  (`data_parallel.py` asks for one and prefetches the next block's parameters in forward), so a block
  computes while the next one's parameters arrive;
- the reduce-scatter, during backward, leaves its sums to be finished when the next one is posted
  and at the end of backward (an autograd final callback), so a rank goes on to the next block's
  gradients instead of waiting for its peer's. FSDP2 only views its output until then (see
  `PeerReduceScatter` for when that holds).

The results are gloo's: an all-gather is a copy, and each rank adds the chunks of a reduce-scatter
in rank order (over two ranks the same two numbers as gloo; over more, another order than gloo's
all-reduce: float32 round-off).
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin


class Exchange(dist.Work):
    """Sends and receives in flight; `finish` runs once, after they have all completed."""

    def __init__(self, requests: list[dist.Work], finish: Callable[[], None] | None = None):
        super().__init__()
        self._requests, self._finish = requests, finish

    def wait(self, timeout=None) -> bool:
        for request in self._requests:
            request.wait()
        self._requests = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None and not self._requests


def _exchange(
    group: dist.ProcessGroup, send: Callable[[int], torch.Tensor], receive: Callable[[int], torch.Tensor]
) -> list[dist.Work]:
    """Post, for every peer of this rank in `group`, a send of `send(peer)` and a receive into
    `receive(peer)` (group ranks). Every rank posts in the same order, which is how gloo pairs
    sends with receives."""
    rank, operations = group.rank(), []
    for peer in range(group.size()):
        if peer != rank:
            peer_global = dist.get_global_rank(group, peer)
            operations.append(dist.P2POp(dist.isend, send(peer), peer_global, group))
            operations.append(dist.P2POp(dist.irecv, receive(peer), peer_global, group))
    return dist.batch_isend_irecv(operations)


class PeerAllGather(DefaultAllocMixin, AllGather):
    """Each rank sends its chunk to every peer and receives theirs; asynchronous when asked."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        chunks = output_tensor.view(group.size(), -1)
        own = chunks[group.rank()]
        if input_tensor.data_ptr() != own.data_ptr():  # FSDP2 gathers in place: already there
            own.copy_(input_tensor.view(-1))
        exchange = Exchange(_exchange(group, send=lambda peer: own, receive=lambda peer: chunks[peer]))
        if async_op:
            return exchange
        exchange.wait()
        return None


class PeerReduceScatter(DefaultAllocMixin, ReduceScatter):
    """Each rank sends chunk j of its input to rank j and sums what it receives for its own chunk.
    SUM and AVG (FSDP2's ops for float32 and bfloat16 gradients); any other op is gloo's own.

    `defer_in_backward`: during backward, finish a reduce-scatter when the next one is posted, and
    the last at the end of backward. Only where FSDP2 does nothing with the output before the
    optimizer but view it as the sharded gradients: op AVG (no division after it), output in the
    parameters' dtype (no cast), no all-reduce after it (plain FSDP, not HSDP), and no gradient to
    add it to (one microbatch a step, or training.gradient_sync=last_microbatch: the first reduction
    after zero_grad(set_to_none)).
    """

    def __init__(self, defer_in_backward: bool = False):
        self.defer_in_backward = defer_in_backward
        self._in_flight: Exchange | None = None
        self._finishing_after = -1  # the backward pass (autograd graph task) that will finish them

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        size, rank = group.size(), group.rank()
        chunks = input_tensor.view(size, -1)
        received = {peer: torch.empty_like(chunks[0]) for peer in range(size) if peer != rank}

        def finish() -> None:
            total = output_tensor.view(-1)
            parts = [chunks[rank] if peer == rank else received[peer] for peer in range(size)]
            torch.add(parts[0], parts[1], out=total)
            for part in parts[2:]:
                total.add_(part)
            if op == dist.ReduceOp.AVG:
                total.div_(size)

        exchange = Exchange(_exchange(group, send=lambda peer: chunks[peer], receive=received.__getitem__), finish)
        backward = torch._C._current_graph_task_id()  # -1 outside backward
        self.finish_in_flight()  # at most one in flight: its input is a whole block's gradients
        if self.defer_in_backward and op == dist.ReduceOp.AVG and backward != -1:
            if self._finishing_after != backward:
                torch.autograd.Variable._execution_engine.queue_callback(self.finish_in_flight)
                self._finishing_after = backward
            self._in_flight = exchange
            return None
        if async_op:
            return exchange
        exchange.wait()
        return None

    def finish_in_flight(self) -> None:
        if self._in_flight is not None:
            exchange, self._in_flight = self._in_flight, None
            exchange.wait()

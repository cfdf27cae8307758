"""Context parallelism: every rank of the cp mesh dimension holds a slice of each sequence.

Both implementations split a sequence into 2·cp chunks and give rank r chunks r and 2·cp-1-r (the
load-balanced, "zig-zag" assignment torch uses: under a causal mask every rank then has the same
amount of attention work), and shard the tokens, the labels and the rotary table alike.

- `torch` (CUDA): torch's ring attention (torch.distributed.tensor.experimental.context_parallel).
  torch 2.13 implements it for the CUDA attention kernels only; the CPU kernel
  (aten._scaled_dot_product_flash_attention_for_cpu) has no sharding strategy.
- `allgather` (any device, any backend): every attention layer all-gathers K and V over the cp
  ranks (the kv heads, before grouped-query attention repeats them) and attends from its two chunks
  to the gathered prefix each may see. Backward runs through autograd: the gather's gradient is a
  reduce-scatter. It holds the whole sequence's K and V per layer for a moment, which ring attention
  avoids; on 2-8 ranks that is small next to the rest (see estimate/memory.py).
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import set_rotate_method
from torch.nn.attention import SDPBackend, sdpa_kernel


def load_balanced_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The token positions cp rank `rank` holds: chunks `rank` and 2·cp-1-`rank` of 2·cp."""
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over `group`; the gradient is reduce-scattered back (summed over the
    ranks that used this rank's slice, each rank keeping its own)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        gathered = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(gathered, local.contiguous(), group=group)
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        local = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_single(local, grad.contiguous(), group=ctx.group)
        return local, None


class AllGatherAttention:
    """Causal attention for a rank's two load-balanced chunks, against K and V gathered from the
    cp ranks. Takes and returns (batch, local seq, heads, head_dim), as Attention.attend does."""

    def __init__(self, cp_group: dist.ProcessGroup):
        self.group = cp_group
        self.cp, self.rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
        chunks = 2 * self.cp
        # Gathered order is rank-major (each rank's two chunks); this puts the chunks in sequence order.
        gathered_chunks = [c for r in range(self.cp) for c in (r, chunks - 1 - r)]
        self.to_sequence_order = torch.tensor(sorted(range(chunks), key=gathered_chunks.__getitem__))
        self.my_chunks = (self.rank, chunks - 1 - self.rank)
        self._masks: dict[tuple, torch.Tensor] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        chunk = q.shape[1] // 2
        k, v = (self._gather(t, chunk) for t in (k, v))
        repeats = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(repeats, dim=2).transpose(1, 2)
        v = v.repeat_interleave(repeats, dim=2).transpose(1, 2)
        outputs = []
        for half, index in enumerate(self.my_chunks):
            # Chunk `index` sees every key up to its own end: the chunks before it, and itself causally.
            keys = (index + 1) * chunk
            q_half = q[:, half * chunk : (half + 1) * chunk].transpose(1, 2)
            mask = self._causal_mask(chunk, keys, q)
            outputs.append(F.scaled_dot_product_attention(q_half, k[:, :, :keys], v[:, :, :keys], attn_mask=mask))
        return torch.cat(outputs, dim=2).transpose(1, 2)

    def _gather(self, local: torch.Tensor, chunk: int) -> torch.Tensor:
        """(batch, 2·chunk, kv heads, head_dim) here -> (batch, seq, kv heads, head_dim), in sequence order."""
        gathered = _GatherSequence.apply(local.transpose(0, 1), self.group)  # sequence first: dim 0 is gathered
        gathered = gathered.unflatten(0, (2 * self.cp, chunk))
        ordered = gathered.index_select(0, self.to_sequence_order.to(gathered.device)).flatten(0, 1)
        return ordered.transpose(0, 1)

    def _causal_mask(self, queries: int, keys: int, like: torch.Tensor) -> torch.Tensor:
        """Query i (the last `queries` positions of `keys`) sees keys 0..keys-queries+i. Additive, in
        the queries' dtype and made once: a boolean mask is converted on every call, and each layer
        would keep its own copy for its backward."""
        key = (queries, keys, like.device, like.dtype)
        if key not in self._masks:
            visible = torch.ones(queries, keys, dtype=torch.bool, device=like.device).tril(keys - queries)
            mask = torch.zeros(queries, keys, dtype=like.dtype, device=like.device)
            self._masks[key] = mask.masked_fill_(~visible, float("-inf"))
        return self._masks[key]


class AllGatherContextParallel:
    """The all-gather implementation over the model parts of this rank (every stage under pipelining).
    A part keeps its rotary table in the buffer `freqs_cis` and its attention layers take their
    attention function from their attribute `attend`."""

    def __init__(self, parts: list[nn.Module], cp_mesh: DeviceMesh, seq_len: int):
        group = cp_mesh.get_group()
        self.positions = load_balanced_positions(seq_len, cp_mesh.size(), dist.get_rank(group))
        attention = AllGatherAttention(group)
        for part in parts:
            # The rotary table holds this rank's positions, in the order its tokens come.
            part.freqs_cis = part.freqs_cis[self.positions.to(part.freqs_cis.device)].clone()
            for module in part.modules():
                if hasattr(module, "attend"):  # the attention layers (models/common/transformer.py)
                    module.attend = attention

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of (batch, seq) sequences."""
        return batch.index_select(1, self.positions.to(batch.device))

    @contextlib.contextmanager
    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield self.shard(inputs), self.shard(labels)


class TorchContextParallel:
    """torch's ring attention (CUDA kernels only) for one model part (no pipelining)."""

    def __init__(self, model: nn.Module, cp_mesh: DeviceMesh, seq_len: int):
        """`model` keeps its rotary table in the buffer `freqs_cis` (positions along dim 0)."""
        self.cp_mesh = cp_mesh
        # The rotary table is sharded with the tokens, so it must cover exactly the trained length.
        model.freqs_cis = model.freqs_cis[:seq_len].clone()
        self.model = model
        set_rotate_method("allgather")

    @contextlib.contextmanager
    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Shards inputs, labels and the rotary table in place along the sequence (load-balanced)
        for one forward + backward."""
        buffers = [inputs, labels, self.model.freqs_cis]
        with (
            context_parallel(
                self.cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers={inputs, labels}
            ),
            sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]),
        ):
            yield inputs, labels


def build_context_parallel(
    implementation: str, parts: list[nn.Module], cp_mesh: DeviceMesh, seq_len: int
) -> AllGatherContextParallel | TorchContextParallel:
    """`implementation` resolved (not auto); config/check.py refused torch's off CUDA and under pipelining."""
    if implementation == "torch":
        [model] = parts
        return TorchContextParallel(model, cp_mesh, seq_len)
    return AllGatherContextParallel(parts, cp_mesh, seq_len)

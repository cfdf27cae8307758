"""The planner's routing traffic (estimate/gpu_compute._routing_bytes) against titan_exp's own MoE
layer: the layer runs in bfloat16 on CPU down its GPU path (torch._grouped_mm, which CPU builds of
torch also have), and a dispatch mode adds up what each aten op reads and writes, as the op does on
a GPU, for the ops that copy routed rows."""

import collections
import dataclasses

import pytest
import torch
import torch.distributed as dist
from layouts import layout
from torch.utils._python_dispatch import TorchDispatchMode

from titan_exp.estimate.gpu_compute import _routing_bytes
from titan_exp.estimate.workload import Workload
from titan_exp.models.common.moe import layer as moe_layer
from titan_exp.models.common.moe.config import MoEConfig
from titan_exp.models.config import ModelConfig
from titan_exp.parallel.config import ActivationCheckpointConfig

# Widths apart from each other and from every other tensor's (the router's experts, top_k), so
# an op over routed rows is known by its last dimension.
DIM, HIDDEN, EXPERTS, TOKENS = 256, 96, 8, 4096
# Ops that move no data (views, allocations), and those the planner prices elsewhere: GEMMs (the
# experts' and the router's), the experts' activation (silu, its product, their gradients), and
# collectives (the c10d namespace's: EP's all-to-alls, estimate/step_time.py).
_NOT_ROUTING = {
    "view", "_unsafe_view", "expand", "t", "transpose", "unsqueeze", "squeeze", "slice", "select", "detach",
    "alias", "as_strided", "reshape", "permute", "split_with_sizes", "new_empty", "empty", "mm", "addmm",
    "_grouped_mm", "silu", "silu_backward", "mul",
}  # fmt: skip
# Accumulating scatters: autograd's gradient of an indexing gather. Under a dispatch mode autograd
# takes the out-of-place index_put; a real run scatters into the zeros in place (_index_put_impl_).
_SCATTERS = {"index_put", "index_put_", "_index_put_impl_"}


def _bytes(tensors: list) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _scattered(target: torch.Tensor, indices: list, values: torch.Tensor) -> int:
    """An accumulating scatter as CUDA runs it (aten's sorted accumulation, Indexing.cu's
    indexing_backward_kernel): the values read, each distinct target row read and written once."""
    rows = torch.unique(indices[0]).numel()
    return _bytes([values]) + 2 * rows * target[0].numel() * target.element_size()


class _RoutedRowTraffic(TorchDispatchMode):
    """Bytes read and written by the ops that touch a routed row's or an expert's hidden width,
    each as its GPU kernel moves them: a fill writes its output; a gather reads and writes the rows
    it picks; a scatter reads its rows and writes them, or accumulates them (_scattered); any other
    op reads its inputs and writes its outputs. `sums_elsewhere`: backward's adds are the gradient
    sums the planner prices apart (_gradient_sums_bytes), forward's are the biases'."""

    def __init__(self, sums_elsewhere: bool):
        super().__init__()
        self.skipped = _NOT_ROUTING | ({"add"} if sums_elsewhere else set())
        self.moved = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        tensors = [t for t in (*args, *outputs) if isinstance(t, torch.Tensor) and t.dim()]
        routed = any(t.shape[-1] in (DIM, HIDDEN) for t in tensors)
        if name in self.skipped or func.namespace == "c10d" or not routed:
            return out
        if name in ("new_zeros", "zeros", "zeros_like"):
            moved = _bytes(outputs)
        elif name in ("index", "index_select", "gather"):
            moved = 2 * _bytes(outputs)
        elif name in _SCATTERS:
            moved = _scattered(args[0], args[1], args[2])
        elif name == "index_copy_":
            moved = 2 * _bytes([args[3]])
        else:
            moved = _bytes([a for a in args if isinstance(a, torch.Tensor)]) + _bytes(outputs)
        self.moved[name] += moved
        return out


def _measured(monkeypatch, top_k: int, bias: bool, ep_group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """(forward, backward) bytes per routed element of the layer's routing ops; with `ep_group`, its
    experts run on that group's ranks (models/common/moe/dispatch.py)."""
    monkeypatch.setattr(moe_layer, "grouped_mm_applies", lambda rows, weight: True)
    cfg = MoEConfig(num_experts=EXPERTS, top_k=top_k, hidden_dim=HIDDEN, score_func="softmax", bias=bias)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = moe_layer.MoE(DIM, cfg).to(torch.bfloat16)
        for parameter in layer.parameters():
            torch.nn.init.normal_(parameter, std=0.02)
        layer.experts.ep_group = ep_group
        x = torch.randn(1, TOKENS, DIM, dtype=torch.bfloat16, requires_grad=True)
        gradient = torch.randn(1, TOKENS, DIM, dtype=torch.bfloat16)
    forward, backward = _RoutedRowTraffic(sums_elsewhere=False), _RoutedRowTraffic(sums_elsewhere=True)
    with forward:
        out = layer(x)
    with backward:
        out.backward(gradient)
    elements = TOKENS * top_k * DIM
    return sum(forward.moved.values()) / elements, sum(backward.moved.values()) / elements


def _planned(top_k: int, bias: bool, compiled: bool = False, ep: int = 1) -> tuple[float, float]:
    moe = MoEConfig(num_experts=EXPERTS, top_k=top_k, hidden_dim=HIDDEN, bias=bias)
    model = ModelConfig(dim=DIM, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=128, moe=moe)
    parallelism = layout(dp_shard=ep, ep=ep)
    w = Workload(model, parallelism, ActivationCheckpointConfig(), 1, TOKENS, param_dtype="bfloat16")
    w = dataclasses.replace(w, compiled=compiled)
    return tuple(moved / (top_k * DIM) for moved in _routing_bytes(w))


@pytest.mark.parametrize("top_k, bias", [(1, False), (2, False), (4, False), (2, True)])
def test_the_planner_counts_the_routing_traffic_the_eager_layer_moves(monkeypatch, top_k: int, bias: bool) -> None:
    """Across top_k (its per-token terms apart from its per-row ones) and with expert biases."""
    assert _planned(top_k, bias) == pytest.approx(_measured(monkeypatch, top_k, bias), rel=0.03)


@pytest.fixture
def one_rank_group():
    """This process as the one rank of a gloo group: the exchanges are identities, the regrouping runs."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_expert_parallelism_adds_the_regrouping_the_planner_counts(monkeypatch, one_rank_group) -> None:
    """The received rows regrouped by local expert and back (a gather each way and their scatters):
    what the layer moves beyond the same layer without EP, against what the planner adds for EP."""
    with_ep, without = _measured(monkeypatch, 2, False, one_rank_group), _measured(monkeypatch, 2, False)
    added = [planned - plain for planned, plain in zip(_planned(2, False, ep=2), _planned(2, False))]
    assert [ep - plain for ep, plain in zip(with_ep, without)] == pytest.approx(added, rel=0.03)


def test_compiled_routing_is_planned_as_fewer_passes_than_eager() -> None:
    compiled, eager = _planned(2, False, compiled=True), _planned(2, False)
    assert compiled[0] < eager[0] and compiled[1] < eager[1]

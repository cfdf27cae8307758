"""The planner's routing traffic (estimate/gpu_compute._routing_bytes) against titan_exp's own MoE
layer: the layer runs in bfloat16 on CPU down its GPU path (torch._grouped_mm, which CPU builds of
torch also have), and a dispatch mode adds up what each aten op reads and writes, as the op does on
a GPU, for the ops that copy routed rows."""

import collections
import dataclasses

import pytest
import torch
from layouts import layout
from torch.utils._python_dispatch import TorchDispatchMode

from titan_exp.estimate.gpu_compute import _routing_bytes
from titan_exp.estimate.workload import Workload
from titan_exp.models.common.moe import layer as moe_layer
from titan_exp.models.common.moe.config import MoEConfig
from titan_exp.models.config import ModelConfig
from titan_exp.parallel.config import ActivationCheckpointConfig

# Model width apart from the experts' hidden width and every other tensor's, so an op over routed
# rows is known by its last dimension.
DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 256, 96, 8, 2, 4096
# Ops that move no data (views), and those the planner prices elsewhere: GEMMs (the experts' and
# the router's), and backward's gradient sums (_gradient_sums_bytes).
_NOT_ROUTING = {
    "view", "_unsafe_view", "expand", "t", "transpose", "unsqueeze", "squeeze", "slice", "select", "detach",
    "alias", "as_strided", "reshape", "permute", "split_with_sizes", "mm", "addmm", "_grouped_mm", "add",
}  # fmt: skip


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class _RoutedRowTraffic(TorchDispatchMode):
    """Bytes read and written by the ops that touch a model-wide tensor, each as its CUDA kernel
    moves them: a fill writes its output; a gather reads and writes the rows it picks; a scatter
    with accumulation reads its rows and reads and writes each target row (in place: autograd
    scatters a gather's gradient into fresh zeros); index_copy out of place clones its input first;
    any other op reads its inputs and writes its outputs."""

    def __init__(self):
        super().__init__()
        self.moved = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        tensors = [t for t in (*args, *outputs) if isinstance(t, torch.Tensor)]
        if name in _NOT_ROUTING or not any(t.shape[-1] == DIM for t in tensors if t.dim()):
            return out
        written = _bytes(outputs)
        if name in ("new_zeros", "zeros", "zeros_like"):
            moved = written
        elif name in ("index", "index_select", "gather"):
            moved = 2 * written
        elif name in ("index_put", "index_put_"):
            moved = 3 * _bytes([args[2]])
        elif name == "index_copy":
            moved = 2 * _bytes([args[0]]) + 2 * _bytes([args[3]])
        else:
            moved = _bytes([a for a in args if isinstance(a, torch.Tensor)]) + written
        self.moved[name] += moved
        return out


def _measured(monkeypatch) -> tuple[float, float]:
    """(forward, backward) bytes per routed element of the layer's routing ops."""
    monkeypatch.setattr(moe_layer, "grouped_mm_applies", lambda rows, weight: True)
    cfg = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, hidden_dim=HIDDEN, score_func="softmax")
    torch.manual_seed(0)
    layer = moe_layer.MoE(DIM, cfg).to(torch.bfloat16)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    x = torch.randn(1, TOKENS, DIM, dtype=torch.bfloat16, requires_grad=True)
    gradient = torch.randn(1, TOKENS, DIM, dtype=torch.bfloat16)
    forward, backward = _RoutedRowTraffic(), _RoutedRowTraffic()
    with forward:
        out = layer(x)
    with backward:
        out.backward(gradient)
    elements = TOKENS * TOP_K * DIM
    return sum(forward.moved.values()) / elements, sum(backward.moved.values()) / elements


def _planned(compiled: bool = False) -> tuple[float, float]:
    moe = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, hidden_dim=HIDDEN)
    model = ModelConfig(dim=DIM, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=128, moe=moe)
    w = Workload(model, layout(dp_shard=1), ActivationCheckpointConfig(), 1, TOKENS, param_dtype="bfloat16")
    w = dataclasses.replace(w, compiled=compiled)
    return tuple(moved / (TOP_K * DIM) for moved in _routing_bytes(w))


def test_the_planner_counts_the_routing_traffic_the_eager_layer_moves(monkeypatch) -> None:
    measured, planned = _measured(monkeypatch), _planned()
    assert planned == pytest.approx(measured, rel=0.05)
    # Several passes over the rows each way, not one: what a gather-sort-scatter costs eagerly.
    assert measured[0] > 20 and measured[1] > 30


def test_compiled_routing_is_planned_as_fewer_passes_than_eager() -> None:
    compiled, eager = _planned(compiled=True), _planned()
    assert compiled[0] < eager[0] and compiled[1] < eager[1]

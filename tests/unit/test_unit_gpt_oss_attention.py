"""GPT-OSS's attention (models/gpt_oss/attention.py) by its properties: a windowed layer's query
does not see keys beyond its window (a full layer's does), a sink of −∞ leaves causal attention
(SDPA's), a sink takes its share of every query's attention, FlexAttention's form (the CUDA path;
run here uncompiled) equals the dense one; the planner counts a windowed layer's keys; context
parallelism is refused in one line."""

import math

import pytest
import torch
import torch.nn.functional as F

from titan_exp.config.compose import compose_job_config
from titan_exp.config.resolve import resolve
from titan_exp.models.gpt_oss.attention import (
    _dense_sink_attention,
    _flex_sink_attention,
    _mask,
    flex_visible,
    sink_attention,
)
from titan_exp.models.registry import build_model
from titan_exp.rules import ConfigError

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 2, 24, 4, 2, 8, 5


def qkv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(BATCH, SEQ, KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("window", [WINDOW, None], ids=["sliding", "full"])
def test_a_query_sees_exactly_the_keys_of_its_window(window):
    q, k, v = qkv()
    sinks = torch.randn(HEADS)
    before = sink_attention(q, k, v, sinks, 0.3, window, None)
    query, far = 20, 20 - WINDOW  # the first key beyond the window of query 20
    k2, v2 = k.clone(), v.clone()
    k2[:, far], v2[:, far] = k2[:, far] + 5, v2[:, far] - 5
    after = sink_attention(q, k2, v2, sinks, 0.3, window, None)
    changed = not torch.allclose(before[:, query], after[:, query])
    assert changed == (window is None)
    assert not torch.allclose(before[:, far], after[:, far])  # the key's own query sees it either way


def test_a_sink_of_minus_infinity_is_causal_attention_and_a_sink_takes_its_share():
    q, k, v = qkv()
    none = sink_attention(q, k, v, torch.full((HEADS,), -math.inf), HEAD_DIM**-0.5, None, None)
    repeats = HEADS // KV_HEADS
    sdpa = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(repeats, 2).transpose(1, 2),
        v.repeat_interleave(repeats, 2).transpose(1, 2), is_causal=True,
    ).transpose(1, 2)  # fmt: skip
    torch.testing.assert_close(none, sdpa, rtol=1e-5, atol=1e-5)
    # A sink of logit s takes e^s / (Z + e^s) of a query's attention: its output shrinks by Z / (Z + e^s).
    sink = torch.full((HEADS,), 2.0)
    scores = (q.transpose(1, 2) @ k.repeat_interleave(repeats, 2).transpose(1, 2).transpose(-2, -1)) * HEAD_DIM**-0.5
    z = scores.masked_fill(~_mask(SEQ, None, None, q.device), -math.inf).exp().sum(-1)  # (batch, heads, seq)
    shrink = (z / (z + math.exp(2.0))).transpose(1, 2).unsqueeze(-1)
    torch.testing.assert_close(sink_attention(q, k, v, sink, HEAD_DIM**-0.5, None, None), sdpa * shrink)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # on purpose here
@pytest.mark.parametrize("window", [WINDOW, None], ids=["sliding", "full"])
def test_flex_attentions_form_equals_the_dense_one(window):
    """The CUDA path's arithmetic (FlexAttention's log-sum-exp, the sink applied after), run here
    uncompiled on the CPU, against the dense scores, within documents too."""
    q, k, v = (t.transpose(1, 2) for t in qkv(1))
    sinks = torch.randn(HEADS)
    documents = torch.tensor([[0] * 7 + [1] * 10 + [2] * 7, [0] * 24])
    for docs in (None, documents):
        dense = _dense_sink_attention(q, k, v, sinks, 0.3, _mask(SEQ, window, docs, q.device))
        flex = _flex_sink_attention(q, k, v, sinks, 0.3, flex_visible(window, docs), compiled=False)
        torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_the_planner_counts_a_windowed_layers_keys():
    """On a GPU FlexAttention computes the key blocks (128 × 128) a query block's window touches,
    whole: the mean over the layers, half of them windowed, against a count of those blocks; on a
    CPU every score is computed."""
    m = compose_job_config(["model=gpt_oss_20b"]).model
    seq, block, window = 4096, 128, m.sliding_window
    # A block pair holds a visible score where its largest query − key ≥ 0 and its smallest < window.
    touched = [
        sum(qb * block + block - 1 - kb * block >= 0 and qb * block - (kb * block + block - 1) < window
            for kb in range(seq // block))
        for qb in range(seq // block)
    ]  # fmt: skip
    windowed = block * sum(touched) / len(touched)
    full = (seq + 1) / 2
    assert m.keys_per_query(full, seq, cuda=True) == pytest.approx((windowed + full) / 2, rel=0.01)
    assert m.keys_per_query(full, seq, cuda=False) == seq


def test_context_parallelism_is_refused_in_one_line():
    cfg = compose_job_config(["model=gpt_oss_debug", "parallelism=cp", "launcher.nproc_per_node=2",
                              "launcher.device=cpu"])  # fmt: skip
    with pytest.raises(ConfigError, match="^parallelism.context_parallel_degree=2: GPT-OSS's attention"):
        resolve(cfg)


def test_layers_alternate_from_a_windowed_first_layer():
    model = build_model(compose_job_config(["model=gpt_oss_debug"]).model)
    assert [block.attention.window for block in model.layers.values()] == [16, None, 16, None]

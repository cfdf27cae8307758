"""The model's init (models/llama3/model.py), held to torchtitan's: a tied model's first loss near
ln(vocab), the block linears' spread untruncated, the init the same whatever the layout."""

import dataclasses
import math

import torch

from titan_exp.config.compose import compose_job_config
from titan_exp.models.registry import build_model


def initialised(cfg) -> torch.nn.Module:
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def first_loss(model: torch.nn.Module, tokens: int = 128) -> float:
    batch = torch.randint(0, model.cfg.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(batch)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten()).item()


def test_a_tied_models_first_loss_is_near_ln_vocab():
    """llama3_1b's width and tied embeddings (its layers cut to 1, its vocabulary to 16k for speed:
    the logits' spread at init depends on the width only). N(0, 1) on the shared matrix gave
    logits a spread of √2048 ≈ 45 and a first loss of ~126 on such shapes; the output projection's
    init gives ln V + ~0.5 (a logit spread of ~1)."""
    cfg = dataclasses.replace(compose_job_config(["model=llama3_1b"]).model, n_layers=1, vocab_size=16384)
    assert cfg.tie_word_embeddings and cfg.dim == 2048
    loss = first_loss(initialised(cfg))
    assert abs(loss - math.log(cfg.vocab_size)) / math.log(cfg.vocab_size) < 0.06, loss


def test_block_linears_have_torchtitans_spread():
    """std 0.02 (0.02/√(2(l+1)) for wo, w2, w3), untruncated at these scales: trunc_normal_'s ±2
    absolute bounds, as torchtitan's. Truncated at ±2σ the spread was 0.88× that."""
    model = initialised(dataclasses.replace(compose_job_config([]).model, dim=512, n_layers=2))
    wq, w2 = model.layers["1"].attention.wq.weight, model.layers["1"].feed_forward.w2.weight
    assert abs(wq.std().item() / 0.02 - 1) < 0.01
    assert abs(w2.std().item() / (0.02 / 2**0.5 / 2**0.5) - 1) < 0.01  # layer 1: 0.02/√4
    assert wq.abs().max().item() > 2 * 0.02  # the tails are there

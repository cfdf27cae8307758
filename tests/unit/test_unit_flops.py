"""titan_exp/metrics/flops.py: FLOPs per token against DESIGN's formula 6·(N − N_embedding) +
12·L·H·Q·T (a tied embedding stays in N: torchtitan 0.3.0), with N and N_embedding as the trainer
and the planner pass them."""

import dataclasses

import pytest
import torch

from titan_exp.estimate.workload import model_parameters
from titan_exp.metrics.flops import flops_per_token
from titan_exp.models.config import ModelConfig
from titan_exp.models.registry import build_model

DEBUG = ModelConfig()  # 6 layers, 16 heads of 16, dim 256, vocab 2048
LLAMA3_8B = ModelConfig(
    flavor="8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256,
    multiple_of=1024, ffn_dim_multiplier=1.3, rope_scaling_factor=8.0, max_seq_len=131_072,
)  # fmt: skip


def test_debug_model_by_hand() -> None:
    """N 5,573,888, N_embedding 2048·256 = 524,288: 6·5,049,600 = 30,297,600; attention
    12·6·16·16·256 = 4,718,592."""
    assert flops_per_token(DEBUG, 5_573_888, 524_288, 256) == 30_297_600 + 4_718_592


def test_llama3_8b_at_8k_by_hand() -> None:
    """N 8,030,261,248 less the 128,256·4096 = 525,336,576 embedding: 6·7,504,924,672 =
    45,029,548,032; attention 12·32·32·128·8192 = 12,884,901,888."""
    n, embedding = model_parameters(LLAMA3_8B), 128_256 * 4096
    assert n == 8_030_261_248
    assert flops_per_token(LLAMA3_8B, n, embedding, 8192) == 45_029_548_032 + 12_884_901_888


def test_attention_term_is_linear_in_sequence_length() -> None:
    """Doubling T adds 12·L·H·Q·T; the dense term does not depend on T."""
    short, long = flops_per_token(DEBUG, 5_573_888, 524_288, 256), flops_per_token(DEBUG, 5_573_888, 524_288, 512)
    assert long - short == 12 * 6 * 16 * 16 * 256


def test_embedding_parameters_do_no_matmul_work() -> None:
    """Each embedding parameter taken out of N removes 6 FLOPs per token."""
    assert flops_per_token(DEBUG, 1000, 0, 1) - flops_per_token(DEBUG, 1000, 10, 1) == 60


@pytest.mark.parametrize("tied", [False, True])
def test_trainer_and_planner_pass_the_same_counts(tied: bool) -> None:
    """The trainer passes Transformer.num_params() and the embedding's numel, the planner
    model_parameters() and vocab·dim: the same FLOPs either way."""
    m = dataclasses.replace(DEBUG, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = build_model(m)
    trainer = flops_per_token(m, model.num_params(), model.tok_embeddings.weight.numel(), 256)
    planner = flops_per_token(m, model_parameters(m), m.vocab_size * m.dim, 256)
    assert trainer == planner


def test_a_tied_embedding_still_counts_the_output_matmul_as_torchtitan_does() -> None:
    """A tied weight is counted once in N and stays in: the output projection's matmul runs on it
    (torchtitan 0.3.0's count), so a tied model's FLOPs equal the untied one's."""
    tied = dataclasses.replace(DEBUG, tie_word_embeddings=True)
    untied_flops = flops_per_token(DEBUG, model_parameters(DEBUG), 524_288, 256)
    tied_flops = flops_per_token(tied, model_parameters(tied), 524_288, 256)
    assert tied_flops == untied_flops
    # The dense term: the layers, the final norm and the output projection.
    assert tied_flops == 6 * (6 * 754_176 + 256 + 2048 * 256) + 4_718_592

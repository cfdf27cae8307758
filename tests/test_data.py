"""Data sources and the batch plan that makes every layout see the same global batch."""

import numpy as np
import pytest
from tokenizers import Tokenizer

from titan_exp.data.config import DataConfig
from titan_exp.data.loader import BatchLoader, BatchPlan, SyntheticSource, TextSource
from titan_exp.data.text import prepare_tokens


@pytest.mark.parametrize("dp,local,accumulation", [(1, 8, 1), (2, 4, 1), (4, 1, 2), (2, 1, 4)])
def test_ranks_and_microbatches_partition_the_global_batch(dp, local, accumulation):
    for step in range(3):
        ids = np.concatenate(
            [
                BatchPlan(local, 16, dp, rank, accumulation).sample_ids(step, micro)
                for rank in range(dp)
                for micro in range(accumulation)
            ]
        )
        assert sorted(ids) == list(range(step * 8, (step + 1) * 8))


def test_text_source_is_real_tokenized_text(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path), tokenizer_vocab_size=512)
    tokens_path = prepare_tokens(cfg)
    assert prepare_tokens(cfg) == tokens_path  # cached
    tokenizer = Tokenizer.from_file(str(tokens_path.parent / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 512
    source = TextSource(cfg, seq_len=64, seed=0)
    assert len(source.tokens) > 50_000 and source.tokens.max() < 512
    inputs, labels = BatchLoader(source, BatchPlan(2, 64, 1, 0, 1)).get(0, 0)
    assert inputs.shape == labels.shape == (2, 64)
    assert (inputs[:, 1:] == labels[:, :-1]).all()
    text = tokenizer.decode(inputs[0].tolist())
    assert sum(ch.isalpha() for ch in text) > len(text) // 3  # English prose/code, not noise


def test_user_corpus_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i}: the quick brown fox jumps over the lazy dog." for i in range(400)))
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), corpus_path=str(corpus), tokenizer_vocab_size=300)
    assert TextSource(cfg, seq_len=32, seed=0).num_windows > 10


def test_synthetic_source_is_seeded_and_follows_its_chain():
    cfg = DataConfig(source="synthetic", synthetic_vocab_size=64, synthetic_branching=2)
    a, b = SyntheticSource(cfg, 32, seed=3), SyntheticSource(cfg, 32, seed=3)
    ids = np.arange(4)
    assert (a.samples(ids) == b.samples(ids)).all()
    rows = a.samples(ids).tolist()
    assert all(nxt in a.successors[cur] for row in rows for cur, nxt in zip(row, row[1:]))
    assert not (SyntheticSource(cfg, 32, seed=4).samples(ids) == a.samples(ids)).all()

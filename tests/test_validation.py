"""The held-out loss (validation.*): a split never trained on, refused in one line when mis-set.
That it is logged as loss/validation at its steps, the same on every layout (pipelines too), is
held in test_parity.py, whose experiment=loss_parity run validates every 5 steps."""

import numpy as np
import pytest
import torch

from titan_exp.data.config import DataConfig
from titan_exp.data.loader import SyntheticSource, TextSource

from conftest import run_cli


def test_the_held_out_windows_are_never_trained_on(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i}: the quick brown fox jumps over the lazy dog." for i in range(400)))
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), corpus_path=str(corpus), tokenizer_vocab_size=300)
    train = TextSource(cfg, seq_len=32, seed=0, split="train", held_out=0.1)
    held_out = TextSource(cfg, seq_len=32, seed=0, split="validation", held_out=0.1)
    whole = TextSource(cfg, seq_len=32, seed=0)
    assert train.num_windows + held_out.num_windows == whole.num_windows and held_out.num_windows > 0
    # Two epochs of each split: every window of one, none of the other's.
    trained = {train._window(i) for i in range(2 * train.num_windows)}
    validated = {held_out._window(i) for i in range(2 * held_out.num_windows)}
    assert trained.isdisjoint(validated) and len(trained | validated) == whole.num_windows


def test_the_synthetic_validation_split_draws_its_own_samples_of_the_same_chain():
    cfg = DataConfig(source="synthetic", synthetic_vocab_size=64, synthetic_branching=2)
    train, held_out = SyntheticSource(cfg, 32, 0, "train"), SyntheticSource(cfg, 32, 0, "validation")
    ids = np.arange(4)
    assert not torch.equal(train.samples(ids), held_out.samples(ids))
    rows = held_out.samples(ids).tolist()
    assert all(nxt in train.successors[cur] for row in rows for cur, nxt in zip(row, row[1:]))


@pytest.mark.parametrize(
    "override,said",
    [
        ("validation.freq=0", "validation.freq=0: must be > 0"),
        ("validation.steps=-1", "validation.steps=-1: set a positive number of batches"),
        ("validation.held_out_fraction=1.5", "validation.held_out_fraction=1.5: must lie in (0, 1)"),
    ],
)
def test_a_mis_set_validation_is_refused_in_one_line(tmp_path, new_store, override, said):
    uri, db = new_store
    result = run_cli(["validation.enable=true", override, uri], tmp_path)
    assert result.returncode == 2 and said in result.stderr and result.stderr.count("\n") == 1
    assert not db.exists()

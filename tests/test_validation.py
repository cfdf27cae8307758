"""The held-out loss (validation.*): a split never trained on, logged as loss/validation at its
steps, the same on every layout, refused in one line when mis-set."""

import numpy as np
import pytest
import torch

from titan_exp.data.config import DataConfig
from titan_exp.data.loader import SyntheticSource, TextSource
from titan_exp.metric_names import VALIDATION_LOSS

from conftest import mlflow_client, mlflow_runs, run_cli

VALIDATED = [
    "experiment=loss_parity",  # deterministic fp32, synthetic data: layouts agree to ~1e-6
    "parity.layouts=[]",
    "training.steps=4",
    "validation.enable=true",
    "validation.freq=2",
    "validation.steps=2",
]


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


def test_the_validation_loss_is_logged_at_its_steps_and_equal_across_layouts(tmp_path, store):
    """single, fsdp on 2 ranks and 1F1B on 2 pipeline stages (the held-out batches run through the
    schedule's forward-only pass): the same held-out loss at steps 2 and 4."""
    uri, db = store
    layouts = {
        "single": ["parallelism=single"],
        "fsdp": ["parallelism=fsdp", "launcher.nproc_per_node=2", "training.local_batch_size=2"],
        "pp": ["parallelism=pp", "launcher.nproc_per_node=2"],
    }
    for name, overrides in layouts.items():
        result = run_cli([*VALIDATED, *overrides, uri], tmp_path / name)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "validation loss" in result.stdout
    client = mlflow_client(db)
    curves = {}
    for run in mlflow_runs(db):
        history = client.get_metric_history(run.info.run_id, VALIDATION_LOSS)
        curves[run.data.tags["layout"]] = [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)]
    reference = curves.pop("single")
    assert [step for step, _ in reference] == [2, 4]
    assert reference[1][1] < reference[0][1]  # the model learns the chain: the held-out loss falls
    for layout, curve in curves.items():
        assert [step for step, _ in curve] == [2, 4], layout
        for (_, got), (_, want) in zip(curve, reference):
            assert abs(got - want) / want < 1e-4, (layout, curve, reference)

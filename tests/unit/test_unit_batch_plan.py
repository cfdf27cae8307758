"""titan_exp/data/loader.py: which samples each data-parallel rank and microbatch reads (disjoint,
covering the global batch once per step, the same global batch for every layout), and the
synthetic source's rows (a sample's row depends on its id alone; labels are inputs shifted)."""

import numpy as np
import pytest
import torch

from titan_exp.data.config import DataConfig
from titan_exp.data.loader import BatchLoader, BatchPlan, SyntheticSource


def plans(local_batch: int, dp: int, accumulation: int) -> list[BatchPlan]:
    return [BatchPlan(local_batch, 16, dp, rank, accumulation) for rank in range(dp)]


def step_samples(local_batch: int, dp: int, accumulation: int, step: int) -> list[np.ndarray]:
    """Every (microbatch, rank) slice of a step, microbatch-major."""
    return [p.sample_ids(step, mb) for mb in range(accumulation) for p in plans(local_batch, dp, accumulation)]


LAYOUTS = [(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (3, 2, 4), (1, 8, 1)]


@pytest.mark.parametrize("local_batch,dp,accumulation", LAYOUTS)
@pytest.mark.parametrize("step", [0, 1, 7])
def test_a_step_reads_its_global_batch_exactly_once(local_batch: int, dp: int, accumulation: int, step: int) -> None:
    """The slices are disjoint, each of local_batch samples, and together are [t·G, (t+1)·G)."""
    g = local_batch * dp * accumulation
    slices = step_samples(local_batch, dp, accumulation, step)
    assert all(len(s) == local_batch for s in slices)
    together = np.concatenate(slices)
    assert len(set(together.tolist())) == len(together)  # disjoint
    assert sorted(together.tolist()) == list(range(step * g, (step + 1) * g))


def test_every_layout_of_the_same_global_batch_reads_the_same_samples() -> None:
    """Global batch 8: one device, DDP/FSDP over 2 or 4, with or without accumulation."""
    layouts = [(8, 1, 1), (4, 2, 1), (2, 4, 1), (2, 2, 2), (1, 2, 4), (1, 1, 8)]
    for step in range(3):
        seen = {tuple(sorted(np.concatenate(step_samples(*layout, step)).tolist())) for layout in layouts}
        assert seen == {tuple(range(8 * step, 8 * step + 8))}


def test_sample_ids_by_hand() -> None:
    """B 3, dp 2, accumulation 2 (G 12), step 1, microbatch 1, rank 1: 12 + (1·2 + 1)·3 = 21."""
    assert BatchPlan(3, 16, 2, 1, 2).sample_ids(1, 1).tolist() == [21, 22, 23]
    assert BatchPlan(3, 16, 2, 0, 2).sample_ids(0, 0).tolist() == [0, 1, 2]


def test_each_accumulation_microstep_reads_the_next_contiguous_block() -> None:
    """Microbatch m of all ranks together is [t·G + m·dp·B, t·G + (m+1)·dp·B): accumulating
    microsteps in order walks the global batch front to back."""
    local_batch, dp, accumulation, step = 2, 3, 4, 5
    g = local_batch * dp * accumulation
    for mb in range(accumulation):
        ids = np.concatenate([p.sample_ids(step, mb) for p in plans(local_batch, dp, accumulation)])
        start = step * g + mb * dp * local_batch
        assert ids.tolist() == list(range(start, start + dp * local_batch))


def test_consecutive_steps_do_not_overlap() -> None:
    first = set(np.concatenate(step_samples(2, 2, 2, 0)).tolist())
    second = set(np.concatenate(step_samples(2, 2, 2, 1)).tolist())
    assert not first & second and max(first) + 1 == min(second)


SYNTHETIC = DataConfig(source="synthetic", synthetic_vocab_size=64, synthetic_branching=4)


def test_a_synthetic_row_depends_on_its_sample_id_alone() -> None:
    """So that any layout sees the same tokens for the same global sample."""
    source = SyntheticSource(SYNTHETIC, seq_len=16, seed=3)
    batch = source.samples(np.array([5, 6, 7]))
    assert batch.shape == (3, 17) and batch.dtype == torch.int64
    assert torch.equal(source.samples(np.array([6]))[0], batch[1])
    assert torch.equal(SyntheticSource(SYNTHETIC, seq_len=16, seed=3).samples(np.array([7]))[0], batch[2])
    assert not torch.equal(SyntheticSource(SYNTHETIC, seq_len=16, seed=4).samples(np.array([7]))[0], batch[2])


def test_synthetic_rows_follow_the_markov_chain() -> None:
    """Every token's successor is one of its `branching` successors in the chain's table."""
    source = SyntheticSource(SYNTHETIC, seq_len=32, seed=0)
    rows = source.samples(np.arange(8)).tolist()
    for row in rows:
        assert all(0 <= token < 64 for token in row)
        assert all(b in source.successors[a] for a, b in zip(row, row[1:]))


def test_loader_labels_are_inputs_shifted_by_one() -> None:
    source = SyntheticSource(SYNTHETIC, seq_len=16, seed=0)
    plan = BatchPlan(local_batch_size=2, seq_len=16, dp_degree=2, dp_rank=1, accumulation_steps=1)
    inputs, labels = BatchLoader(source, plan).get(step=3, microbatch=0)
    assert inputs.shape == labels.shape == (2, 16)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    # Rank 1 at step 3 of global batch 4 reads samples 14 and 15.
    rows = source.samples(np.array([14, 15]))
    assert torch.equal(inputs, rows[:, :-1]) and torch.equal(labels, rows[:, 1:])

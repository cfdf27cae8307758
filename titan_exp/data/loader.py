"""Batches for one data-parallel rank.

Step t of the run consumes global samples [t·G, (t+1)·G), G the global batch. Microbatch m of
data-parallel rank r takes samples t·G + (m·dp + r)·B + [0, B), B the local batch, so any layout
(single device, DDP, FSDP, with or without accumulation) sees exactly the same global batch, and a
run resumed at step t sees exactly the samples an uninterrupted one would.

Each source has two splits: `train`, and `validation`, held out from it (validation/): the text
corpus's last windows, the synthetic chain's own stream of samples, data=files' documents chosen by
a hash (or validation.paths). data=files is read as a stream (data/files.py): its position at a
step goes into the checkpoint.
"""

from dataclasses import dataclass

import numpy as np
import torch

from titan_exp.data.config import DataConfig
from titan_exp.data.files import FilesSource
from titan_exp.data.text import document_end, prepare_tokens


@dataclass
class BatchPlan:
    local_batch_size: int
    seq_len: int
    dp_degree: int
    dp_rank: int
    accumulation_steps: int

    @property
    def global_batch(self) -> int:
        return self.local_batch_size * self.dp_degree * self.accumulation_steps

    def sample_ids(self, step: int, microbatch: int) -> np.ndarray:
        first = step * self.global_batch + (microbatch * self.dp_degree + self.dp_rank) * self.local_batch_size
        return np.arange(first, first + self.local_batch_size)


SPLITS = ("train", "validation")


class TextSource:
    """Non-overlapping windows of seq_len+1 tokens, visited in a seeded random order per epoch. With
    a held-out fraction, the last windows of the corpus are the validation split's and never trained on."""

    def __init__(self, cfg: DataConfig, seq_len: int, seed: int, split: str = "train", held_out: float = 0.0):
        self.tokens = np.load(prepare_tokens(cfg), mmap_mode="r")
        self.seq_len = seq_len
        windows = (len(self.tokens) - 1) // seq_len
        validation = int(windows * held_out) if held_out else 0
        if held_out and not 0 < validation < windows:
            raise ValueError(f"the corpus's {windows} windows of training.seq_len+1 tokens leave no held-out split")
        self.first_window, self.num_windows = (
            (0, windows - validation) if split == "train" else (windows - validation, validation)
        )
        if self.num_windows < 1:
            raise ValueError(f"the corpus has {len(self.tokens)} tokens, fewer than training.seq_len+1")
        self.seed = seed
        self.document_end = document_end(cfg)

    def _window(self, sample: int) -> int:
        epoch, index = divmod(int(sample), self.num_windows)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        return self.first_window + int(order[index])

    def samples(self, ids: np.ndarray) -> torch.Tensor:
        starts = [self._window(i) * self.seq_len for i in ids]
        rows = [np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))


class SyntheticSource:
    """A fixed random Markov chain: each token has `branching` equally likely successors."""

    def __init__(self, cfg: DataConfig, seq_len: int, seed: int, split: str = "train", held_out: float = 0.0):
        table = np.random.default_rng([seed, 0]).integers(
            cfg.synthetic_vocab_size, size=(cfg.synthetic_vocab_size, cfg.synthetic_branching)
        )
        # Plain lists: walking the chain token by token is cheaper on lists than on arrays or tensors.
        self.successors = table.tolist()
        self.vocab_size = cfg.synthetic_vocab_size
        self.branching = cfg.synthetic_branching
        self.seq_len = seq_len
        self.seed = seed
        # The same chain (the same distribution); the validation split draws its own samples.
        self.stream = 1 + SPLITS.index(split)

    def samples(self, ids: np.ndarray) -> torch.Tensor:
        rows = []
        for sample in ids:
            rng = np.random.default_rng([self.seed, self.stream, int(sample)])
            token = int(rng.integers(self.vocab_size))
            row = [token]
            for choice in rng.integers(self.branching, size=self.seq_len).tolist():
                token = self.successors[token][choice]
                row.append(token)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.int64)


Source = TextSource | SyntheticSource | FilesSource


def build_source(
    cfg: DataConfig,
    seq_len: int,
    seed: int,
    split: str = "train",
    held_out: float = 0.0,
    validation_paths: list[str] = (),
) -> Source:
    """`held_out`: the fraction of the data kept for the validation split (0: no validation);
    `validation_paths`: data=files' validation split read from these globs instead."""
    if cfg.source == "files":
        return FilesSource(cfg, seq_len, seed, split, held_out, validation_paths)
    sources = {"text": TextSource, "synthetic": SyntheticSource}
    return sources[cfg.source](cfg, seq_len, seed, split, held_out)


class BatchLoader:
    def __init__(self, source: Source, plan: BatchPlan):
        self.source = source
        self.plan = plan

    @property
    def streamed(self) -> bool:
        """Read as a stream (data=files), whose position a checkpoint keeps; the other sources
        compute any sample from its index."""
        return isinstance(self.source, FilesSource)

    def state_after(self, step: int) -> str:
        """The stream's position once `step` steps have read their batches."""
        return self.source.state_at(step * self.plan.global_batch)

    def resume(self, state: str) -> None:
        self.source.load_state(state)

    @property
    def document_end(self) -> int | None:
        """The id that ends each document of the stream (None: the source has no documents)."""
        return getattr(self.source, "document_end", None)

    def get(self, step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each (local_batch_size, seq_len): labels are inputs shifted by one."""
        rows = torch.as_tensor(self.source.samples(self.plan.sample_ids(step, microbatch)), dtype=torch.int64)
        return rows[:, :-1], rows[:, 1:]

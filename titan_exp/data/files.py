"""data=files: your own documents, read lazily from `data.paths` (globs of .txt, .jsonl, .parquet
and folders written by `datasets.save_to_disk`), through `data.tokenizer_path`, packed into windows
of seq_len+1 tokens across document boundaries (BOS + ids + EOS each, as torchtitan packs).

The windows form one stream, in file order (the globs' matches sorted) and record order within a
file. Sample i is window i, whatever the layout: every rank reads the stream forward and keeps the
windows its BatchPlan gives it, so the global batch is the same in every layout. Memory holds one
record batch, one record and a piece of its tokens, whatever the corpus's size. The position in the stream
(file, record, the tokens carried over, the window) is what a checkpoint saves: a resumed run reads
on from there, without reading again. Torch-free: the pre-flight reads each split's first window."""

import functools
import itertools
import json
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

from titan_exp.data.documents import expand, records
from titan_exp.data.tokenizer import DocumentTokenizer, load_tokenizer


class TooFewTokensError(ValueError):
    """A split whose documents do not fill one window."""


@dataclass
class Position:
    """Where the stream stands: the record being read and its next piece (a long document is read
    in pieces: tokenizer.py), the tokens read past the last window, and that window's index (the
    next sample)."""

    file: int = 0
    record: int = 0
    window: int = 0
    carry: list[int] = field(default_factory=list)
    piece: int = 0


class FilesSource:
    """Sample i: window i of the stream of this split's documents. `held_out`: the share of
    documents kept for the validation split (chosen by a hash of their place, so the train split
    never sees them); `validation_paths`: the validation split reads these globs instead, and
    nothing of data.paths is held out."""

    def __init__(
        self,
        cfg,
        seq_len: int,
        seed: int,
        split: str = "train",
        held_out: float = 0.0,
        validation_paths: Iterable[str] = (),
    ):
        self.split = split
        given = split == "validation" and validation_paths
        self.files = expand(list(validation_paths if given else cfg.paths))
        self.text_field = cfg.text_field
        self.tokenizer: DocumentTokenizer = load_tokenizer(cfg.tokenizer_path)
        self.document_end = self.tokenizer.eos
        self.window = seq_len + 1
        # Documents whose hash falls below this are the validation split's (0: no split by hash).
        self.threshold = 0 if validation_paths else int(held_out * 2**32)
        self.position = Position()
        self._documents: Iterator[list[int]] | None = None
        # Records without text passed over so far, and the files that had one.
        self.skipped = 0
        self._files_skipping: set[int] = set()

    def _keeps(self, file: int, record: int) -> bool:
        if not self.threshold:
            return True
        held_out = zlib.crc32(f"{file}:{record}".encode()) < self.threshold
        return held_out == (self.split == "validation")

    def _read(self) -> Iterator[list[int]]:
        """Token ids of the documents from the position on, the position following each, for ever."""
        position = self.position
        while True:
            whole_pass, tokens = position.file == position.record == position.piece == 0, 0
            for file in range(position.file, len(self.files)):
                for text in records(self.files[file], self.text_field, position.record):
                    if text is None:
                        self._skipped(file, position.record)
                    elif self._keeps(file, position.record):
                        for piece, ids in enumerate(self.tokenizer.pieces(text)):
                            if piece >= position.piece:  # those before were read before a resume
                                position.piece = piece + 1
                                tokens += len(ids)
                                yield ids
                    position.record, position.piece = position.record + 1, 0
                position.file, position.record = file + 1, 0
            if whole_pass and tokens < self.window:  # else each pass yields a window at least
                more = ", raise validation.held_out_fraction" if self.threshold and self.split == "validation" else ""
                raise TooFewTokensError(
                    f"the {self.split} split's documents hold {tokens} tokens, fewer than one window of "
                    f"training.seq_len+1={self.window}; add documents{more} or lower training.seq_len"
                )
            position.file = 0  # the stream ran out: the next epoch reads the same documents in the same order

    def _skipped(self, file: int, record: int) -> None:
        """A record without text is passed over; the first of each file is said in rank 0's log."""
        self.skipped += 1
        if file not in self._files_skipping and os.environ.get("RANK", "0") == "0":
            self._files_skipping.add(file)
            print(
                f"data: {self.files[file]}: record {record} has no text in {self.text_field!r}; records "
                "without text are skipped",
                flush=True,
            )

    def _next_window(self) -> list[int]:
        position = self.position
        if self._documents is None:
            self._documents = self._read()
        while len(position.carry) < self.window:
            position.carry.extend(next(self._documents))
        window, position.carry = position.carry[: self.window], position.carry[self.window :]
        position.window += 1
        return window

    def _seek(self, window: int) -> None:
        """To window `window`: read on to it, or from the start when it lies behind (the validation
        split's batches are the same ones each time)."""
        if window < self.position.window:
            self.position, self._documents = Position(), None
        while self.position.window < window:
            self._next_window()

    def samples(self, ids: Iterable[int]) -> list[list[int]]:
        rows = []
        for sample in ids:
            self._seek(int(sample))
            rows.append(self._next_window())
        return rows

    def state_at(self, window: int) -> str:
        """The stream's position at `window` (read on to it), as a checkpoint keeps it."""
        self._seek(window)
        return json.dumps(asdict(self.position))

    def load_state(self, state: str) -> None:
        self.position, self._documents = Position(**json.loads(state)), None


# Documents measured for the planner (estimate/documents.py): enough for a steady mean length.
_MEASURED_DOCUMENTS = 2000


@functools.cache
def document_lengths(globs: tuple[str, ...], tokenizer_path: str, text_field: str) -> list[int]:
    """The token counts (BOS and EOS included) of the first documents the globs give, as packed."""
    tokenizer = load_tokenizer(tokenizer_path)
    texts = (text for path in expand(list(globs)) for text in records(path, text_field) if text is not None)
    return [sum(map(len, tokenizer.pieces(text))) for text in itertools.islice(texts, _MEASURED_DOCUMENTS)]

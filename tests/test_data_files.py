"""data=files and data.tokenizer_path: your own documents (txt, jsonl, parquet, a saved `datasets`
folder) through your own tokenizer.json, packed with document boundaries, split across
data-parallel ranks, read lazily, and resumed exactly where a checkpoint left the stream."""

import json
import tracemalloc
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers

from titan_exp.data.config import DataConfig
from titan_exp.data.files import FilesSource
from titan_exp.data.loader import BatchLoader, BatchPlan, build_source
from titan_exp.data.text import load_documents, prepare_tokens, train_tokenizer
from titan_exp.data.tokenizer import load_tokenizer

from conftest import loss_curve, mlflow_runs, run_cli

SEQ = 16
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbo boxes".split()


def documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"Doc {i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) for i in range(count)]


DOCS = documents(120)


def write_formats(folder: Path, docs: list[str]) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docs.txt").write_text("\n\n".join(docs) + "\n")
    (folder / "docs.jsonl").write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"text": docs}), folder / "docs.parquet", row_group_size=16)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(folder / "saved"))
    return {kind: folder / name for kind, name in [("txt", "docs.txt"), ("jsonl", "docs.jsonl"),
                                                    ("parquet", "docs.parquet"), ("saved", "saved")]}  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[dict[str, Path], Path]:
    folder = tmp_path_factory.mktemp("corpus")
    tokenizer_file = folder / "tokenizer.json"
    tokenizer_file.write_text(train_tokenizer(DOCS, 300).to_str())
    return write_formats(folder / "docs", DOCS), tokenizer_file


def files_config(paths: list[Path], tokenizer: Path, **changes) -> DataConfig:
    return DataConfig(source="files", paths=[str(p) for p in paths], tokenizer_path=str(tokenizer), **changes)


def expected_windows(docs: list[str], tokenizer: Path, count: int) -> list[list[int]]:
    encoder = load_tokenizer(str(tokenizer))
    stream = [t for doc in docs for t in encoder.encode(doc)]
    return [stream[i * (SEQ + 1) : (i + 1) * (SEQ + 1)] for i in range(count)]


def test_every_format_gives_the_documents_packed_with_their_boundaries(corpus):
    files, tokenizer = corpus
    expected = expected_windows(DOCS, tokenizer, 20)
    encoder = load_tokenizer(str(tokenizer))
    assert expected[0][0] == encoder.bos and encoder.eos in sum(expected, [])
    for kind, path in files.items():
        source = FilesSource(files_config([path], tokenizer), SEQ, seed=0)
        assert source.samples(np.arange(20)).tolist() == expected, kind


def test_a_stream_that_ends_starts_again(corpus):
    files, tokenizer = corpus
    source = FilesSource(files_config([files["jsonl"]], tokenizer), SEQ, seed=0)
    tokens = sum(len(load_tokenizer(str(tokenizer)).encode(d)) for d in DOCS)
    epoch = tokens // (SEQ + 1)
    first, later = source.samples(np.arange(3)), source.samples(np.arange(epoch + 5, epoch + 8))
    assert later.shape == first.shape  # read past the end: the second epoch


@pytest.mark.parametrize("dp,local,accumulation", [(1, 8, 1), (2, 4, 1), (4, 1, 2)])
def test_data_parallel_ranks_share_out_the_one_global_batch(corpus, dp, local, accumulation):
    files, tokenizer = corpus
    config = files_config([files["parquet"]], tokenizer)
    whole = BatchLoader(FilesSource(config, SEQ, seed=0), BatchPlan(8, SEQ, 1, 0, 1))
    ranks = [
        BatchLoader(FilesSource(config, SEQ, seed=0), BatchPlan(local, SEQ, dp, r, accumulation)) for r in range(dp)
    ]
    for step in range(3):
        rows = {tuple(row) for loader in ranks for m in range(accumulation) for row in loader.get(step, m)[0].tolist()}
        assert rows == {tuple(row) for row in whole.get(step, 0)[0].tolist()}


def test_a_resumed_stream_reads_on_from_its_saved_position(corpus):
    """The position after step 3 (12 windows of 4) loaded into a fresh source: steps 4 and 5 are the
    uninterrupted run's, and the resumed source tokenizes only what comes after the position."""
    files, tokenizer = corpus
    config = files_config([files["txt"], files["jsonl"]], tokenizer)
    plan = BatchPlan(4, SEQ, 1, 0, 1)
    uninterrupted = BatchLoader(FilesSource(config, SEQ, seed=0), plan)
    for step in range(3):
        uninterrupted.get(step, 0)
    state = uninterrupted.state_after(3)
    resumed = BatchLoader(FilesSource(config, SEQ, seed=0), plan)
    resumed.resume(state)
    fresh = BatchLoader(FilesSource(config, SEQ, seed=0), plan)
    read_resumed, read_fresh = [], []
    resumed.source.tokenizer = _Counting(resumed.source.tokenizer, read_resumed)
    fresh.source.tokenizer = _Counting(fresh.source.tokenizer, read_fresh)
    for step in (3, 4):
        assert resumed.get(step, 0)[0].tolist() == uninterrupted.get(step, 0)[0].tolist()
        assert fresh.get(step, 0)[0].tolist() == uninterrupted.get(step, 0)[0].tolist()
    # The fresh source read its way there from the first document; the resumed one did not.
    assert 0 < len(read_resumed) < len(read_fresh) - 3 and read_fresh[0] == DOCS[0] != read_resumed[0]


class _Counting:
    def __init__(self, tokenizer, calls: list):
        self.tokenizer, self.calls = tokenizer, calls

    def encode(self, text: str) -> list[int]:
        self.calls.append(text)
        return self.tokenizer.encode(text)


def test_memory_does_not_grow_with_the_corpus(tmp_path, corpus):
    """The first 40 windows of a corpus ten times larger take no more memory to read."""
    _, tokenizer = corpus

    def peak_reading(docs: list[str], name: str) -> int:
        paths = write_formats(tmp_path / name, docs)
        source = FilesSource(files_config([paths["jsonl"], paths["txt"]], tokenizer), SEQ, seed=0)
        tracemalloc.start()
        source.samples(np.arange(40))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    small, large = peak_reading(documents(2_000), "small"), peak_reading(documents(20_000, seed=1), "large")
    assert large < 1.5 * small, (small, large)


def test_held_out_documents_are_never_trained_on(corpus):
    files, tokenizer = corpus
    config = files_config([files["jsonl"]], tokenizer)
    train = FilesSource(config, SEQ, seed=0, split="train", held_out=0.2)
    validation = FilesSource(config, SEQ, seed=0, split="validation", held_out=0.2)
    kept = {
        split: [i for i in range(len(DOCS)) if src._keeps(0, i)] for split, src in [("t", train), ("v", validation)]
    }
    assert set(kept["t"]).isdisjoint(kept["v"]) and len(kept["t"]) + len(kept["v"]) == len(DOCS)
    assert 0.1 < len(kept["v"]) / len(DOCS) < 0.3
    other = write_formats(Path(str(files["jsonl"].parent) + "_validation"), documents(30, seed=7))
    given = build_source(config, SEQ, 0, "validation", held_out=0.2, validation_paths=[str(other["jsonl"])])
    assert given.samples(np.arange(4)).tolist() == expected_windows(documents(30, seed=7), tokenizer, 4)


def test_a_tokenizer_saved_by_transformers_names_its_own_bos_and_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=["[START]", "[STOP]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(DOCS, trainer)
    (tmp_path / "bare").mkdir()
    tokenizer.save(str(tmp_path / "bare" / "tokenizer.json"))
    with pytest.raises(ValueError, match="no end-of-document token"):
        load_tokenizer(str(tmp_path / "bare" / "tokenizer.json"))  # names no family uses
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="[START]", eos_token="[STOP]")
    fast.save_pretrained(tmp_path / "hf")
    loaded = load_tokenizer(str(tmp_path / "hf" / "tokenizer.json"))
    assert (loaded.bos, loaded.eos) == (tokenizer.token_to_id("[START]"), tokenizer.token_to_id("[STOP]"))
    assert loaded.encode("a fox")[0] == loaded.bos and loaded.encode("a fox")[-1] == loaded.eos


RUN = ["training.seq_len=32", "training.local_batch_size=2", "metrics.log_freq=1", "launcher.device=cpu"]


def files_run(corpus, *more: str) -> list[str]:
    files, tokenizer = corpus
    paths = f"data.paths=[{files['jsonl']},{files['parquet']}]"
    return [*RUN, "data=files", paths, f"data.tokenizer_path={tokenizer}", *more]


def test_a_resumed_run_trains_on_the_tokens_an_uninterrupted_one_does(corpus, tmp_path, store):
    uri, db = store
    two_ranks = ["parallelism=fsdp", "launcher.nproc_per_node=2"]

    def train(folder: Path, steps: int, name: str):
        ckpt = [
            "checkpoint=periodic",
            f"checkpoint.folder={folder}",
            "checkpoint.interval=2",
            f"training.steps={steps}",
        ]
        done = run_cli(files_run(corpus, *two_ranks, *ckpt, uri), tmp_path / name)
        assert done.returncode == 0, done.stderr[-3000:]

    train(tmp_path / "straight", 4, "straight")
    train(tmp_path / "stopped", 2, "first_half")
    train(tmp_path / "stopped", 4, "second_half")
    straight, resumed = (loss_curve(db, run.info.run_id) for run in mlflow_runs(db))  # resumed: one run
    assert len(straight) == len(resumed) == 4
    assert resumed == pytest.approx(straight, rel=1e-6)
    metadata = (tmp_path / "stopped" / "step-4" / ".metadata").read_bytes()
    assert b"dataloader" in metadata


@pytest.mark.parametrize(
    "change,expected",
    [
        (["data.paths=[/nowhere/*.jsonl]"], "data.paths=/nowhere/*.jsonl: matches no file"),
        (["data.text_field=body"], "data.text_field=body: "),
        (["data.tokenizer_path=/nowhere/tokenizer.json"], "data.tokenizer_path=/nowhere/tokenizer.json: no such file"),
        (["model.vocab_size=256"], "token ids exceed model.vocab_size=256"),
    ],
)
def test_bad_files_or_tokenizers_are_refused_before_any_rank_starts(corpus, tmp_path, change, expected):
    done = run_cli([*files_run(corpus, "parallelism=single", "tracking=none"), *change], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert expected in line


def test_the_text_corpus_takes_a_given_tokenizer_too(corpus, tmp_path):
    files, tokenizer = corpus
    config = DataConfig(corpus_path=str(files["txt"]), tokenizer_path=str(tokenizer), cache_dir=str(tmp_path))
    tokens = np.load(prepare_tokens(config))
    encoder = load_tokenizer(str(tokenizer))
    assert tokens.tolist() == [t for doc in load_documents(str(files["txt"])) for t in encoder.encode(doc)]
    assert not (prepare_tokens(config).parent / "tokenizer.json").exists()  # no BPE trained

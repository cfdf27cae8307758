"""data=files and data.tokenizer_path: your own documents (txt, jsonl, parquet, a saved `datasets`
folder) through your own tokenizer.json, packed with document boundaries, split across
data-parallel ranks, read lazily, and resumed exactly where a checkpoint left the stream."""

import gc
import json
import shutil
import tracemalloc
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers

from titan_exp.data.config import DataConfig
from titan_exp.data.documents import records
from titan_exp.data.files import FilesSource
from titan_exp.data.loader import BatchLoader, BatchPlan, build_source
from titan_exp.data.text import load_documents, prepare_tokens, train_tokenizer
from titan_exp.data.tokenizer import load_tokenizer

from conftest import loss_curve, mlflow_client, mlflow_runs, run_cli

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
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(folder / "saved"), num_shards=2)  # two .arrow files
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
        assert source.samples(range(20)) == expected, kind


def test_each_format_reads_on_from_any_record(corpus):
    """A resume's start: from record `start` on, across parquet's row groups of 16 (passed over by
    its metadata) and Arrow's record batches."""
    files, _ = corpus
    for kind, path in files.items():
        for start in (0, 15, 16, 17, 50, 119, 120):
            assert list(records(path, "text", start)) == DOCS[start:], (kind, start)


def test_a_stream_that_ends_starts_again(corpus):
    """At its end the stream reads the documents again in the same order (the next epoch), packing
    on across the seam."""
    files, tokenizer = corpus
    encoder = load_tokenizer(str(tokenizer))
    stream = [t for doc in DOCS for t in encoder.encode(doc)] * 2
    epoch = len(stream) // 2 // (SEQ + 1)
    source = FilesSource(files_config([files["jsonl"]], tokenizer), SEQ, seed=0)
    seam = range(epoch - 2, epoch + 3)
    assert source.samples(seam) == [stream[i * (SEQ + 1) : (i + 1) * (SEQ + 1)] for i in seam]


@pytest.mark.parametrize("dp,local,accumulation", [(1, 8, 1), (2, 4, 1), (4, 1, 2)])
def test_data_parallel_ranks_share_out_the_one_global_batch(corpus, dp, local, accumulation):
    files, tokenizer = corpus
    config = files_config([files["parquet"]], tokenizer)
    whole = BatchLoader(FilesSource(config, SEQ, seed=0), BatchPlan(8, SEQ, 1, 0, 1))
    ranks = [
        BatchLoader(FilesSource(config, SEQ, seed=0), BatchPlan(local, SEQ, dp, r, accumulation)) for r in range(dp)
    ]
    for step in range(3):
        by_sample = {}
        for loader in ranks:
            for m in range(accumulation):
                by_sample.update(zip(loader.plan.sample_ids(step, m).tolist(), loader.get(step, m)[0].tolist()))
        assert [by_sample[i] for i in sorted(by_sample)] == whole.get(step, 0)[0].tolist()


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "saved"])
def test_a_resumed_stream_reads_on_from_its_saved_position(corpus, kind):
    """The position after step 20 (160 windows of 8: past parquet's first row groups) loaded into a
    fresh source: steps 20 and 21 are the uninterrupted run's, and the resumed source tokenizes
    only what comes after the position."""
    files, tokenizer = corpus
    config = files_config([files[kind], files["jsonl"] if kind != "jsonl" else files["txt"]], tokenizer)
    plan = BatchPlan(8, SEQ, 1, 0, 1)
    uninterrupted = BatchLoader(FilesSource(config, SEQ, seed=0), plan)
    for step in range(20):
        uninterrupted.get(step, 0)
    state = uninterrupted.state_after(20)
    assert json.loads(state)["record"] > 32  # in parquet's third row group of 16
    resumed = BatchLoader(FilesSource(config, SEQ, seed=0), plan)
    resumed.resume(state)
    fresh = BatchLoader(FilesSource(config, SEQ, seed=0), plan)
    read_resumed, read_fresh = [], []
    resumed.source.tokenizer = _Counting(resumed.source.tokenizer, read_resumed)
    fresh.source.tokenizer = _Counting(fresh.source.tokenizer, read_fresh)
    for step in (20, 21):
        assert resumed.get(step, 0)[0].tolist() == uninterrupted.get(step, 0)[0].tolist()
        assert fresh.get(step, 0)[0].tolist() == uninterrupted.get(step, 0)[0].tolist()
    # The fresh source read its way there from the first document; the resumed one did not.
    assert 0 < len(read_resumed) < len(read_fresh) - 30 and read_fresh[0] == DOCS[0] != read_resumed[0]


class _Counting:
    def __init__(self, tokenizer, calls: list):
        self.tokenizer, self.calls = tokenizer, calls

    def pieces(self, text: str):
        self.calls.append(text)
        return self.tokenizer.pieces(text)


def test_memory_does_not_grow_with_the_corpus(tmp_path, corpus):
    """The first 40 windows of a corpus ten times larger take no more memory to read, in every
    format: neither Python's (tracemalloc) nor Arrow's (the peak of a pool of its own)."""
    _, tokenizer = corpus

    def peaks(path: Path) -> tuple[int, int]:
        source = FilesSource(files_config([path], tokenizer), SEQ, seed=0)
        previous = pa.default_memory_pool()
        pool = pa.proxy_memory_pool(previous)
        pa.set_memory_pool(pool)
        tracemalloc.start()
        source.samples(range(40))
        python_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del source  # its reader's Arrow buffers go back to the pool before the pool goes
        gc.collect()
        pa.set_memory_pool(previous)
        return python_peak, pool.max_memory()

    small, large = (
        write_formats(tmp_path / "small", documents(2_000)),
        write_formats(tmp_path / "large", documents(20_000, seed=1)),
    )
    for kind in small:
        (python_small, arrow_small), (python_large, arrow_large) = peaks(small[kind]), peaks(large[kind])
        assert python_large < 1.5 * python_small and arrow_large <= 1.5 * arrow_small, (kind, small, large)


def documents_read(source: FilesSource, windows: int = 2_000) -> set[str]:
    """The documents `source` tokenizes for its first windows (past an epoch of these corpora)."""
    read: list[str] = []
    source.tokenizer = _Counting(source.tokenizer, read)
    source.samples(range(windows))
    return set(read)


def test_held_out_documents_are_never_trained_on(corpus, tmp_path):
    files, tokenizer = corpus
    more = documents(60, seed=3)
    config = files_config([files["jsonl"], write_formats(tmp_path / "more", more)["parquet"]], tokenizer)
    train, validation = (
        documents_read(FilesSource(config, SEQ, seed=0, split=split, held_out=0.2)) for split in ("train", "validation")
    )
    assert train.isdisjoint(validation) and train | validation == set(DOCS + more)
    assert 0.1 < len(validation) / len(DOCS + more) < 0.3
    # validation.paths: the validation split reads them, and the train split every document of data.paths.
    other = write_formats(tmp_path / "validation", documents(30, seed=7))
    given = build_source(config, SEQ, 0, "validation", held_out=0.2, validation_paths=[str(other["jsonl"])])
    assert given.samples(range(4)) == expected_windows(documents(30, seed=7), tokenizer, 4)
    train = build_source(config, SEQ, 0, "train", held_out=0.2, validation_paths=[str(other["jsonl"])])
    assert documents_read(train) == set(DOCS + more)


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


def test_bos_and_eos_from_a_tokenizer_config_in_either_form_or_the_usual_names(tmp_path):
    """tokenizer_config.json's bos_token/eos_token as a string or as {"content": ...}; without one,
    the family names; a tokenizer with an EOS but no BOS separates documents by EOS alone."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    def saved(name: str, specials: list[str], config: dict | None = None) -> str:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=270, special_tokens=specials, initial_alphabet=alphabet)
        tokenizer.train_from_iterator(DOCS, trainer)
        (tmp_path / name).mkdir()
        tokenizer.save(str(tmp_path / name / "tokenizer.json"))
        if config is not None:
            (tmp_path / name / "tokenizer_config.json").write_text(json.dumps(config))
        return str(tmp_path / name / "tokenizer.json")

    both = ["<s>", "</s>", "<|endoftext|>"]  # <s> 0, </s> 1, <|endoftext|> 2
    named = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "<|endoftext|>"}
    from_config, from_names = load_tokenizer(saved("config", both, named)), load_tokenizer(saved("names", both))
    assert (from_config.bos, from_config.eos) == (0, 2) and (from_names.bos, from_names.eos) == (0, 1)
    eos_only = load_tokenizer(saved("eos_only", ["<|endoftext|>"]))
    assert eos_only.bos is None and eos_only.encode("a fox")[-1] == eos_only.eos == 0
    assert eos_only.eos not in eos_only.encode("a fox")[:-1] and eos_only.vocab_size == 270
    with pytest.raises(ValueError, match="names eos_token <eos>, which it does not hold"):
        load_tokenizer(saved("wrong", both, {"eos_token": "<eos>"}))


RUN = ["training.seq_len=32", "training.local_batch_size=2", "metrics.log_freq=1", "launcher.device=cpu"]


def files_run(corpus, *more: str) -> list[str]:
    files, tokenizer = corpus
    paths = f"data.paths=[{files['jsonl']},{files['parquet']}]"
    return [*RUN, "data=files", paths, f"data.tokenizer_path={tokenizer}", *more]


@pytest.mark.parametrize(
    "layout",
    [
        "parallelism=fsdp",
        pytest.param("parallelism=pp parallelism.pipeline_parallel_schedule=Interleaved1F1B", marks=pytest.mark.slow),
    ],
)
def test_a_resumed_run_continues_the_same_curve_on_the_same_tokens(corpus, tmp_path, store, layout):
    """Killed after step 10 with its newest checkpoint cut short, a job resumes from the one before,
    reading on in the documents where it left them, in the same MLflow run: the curve it goes on
    with is the uninterrupted one's (other documents would give other losses)."""
    uri, db = store
    folder = tmp_path / "ckpt"
    ckpt = ["checkpoint=periodic", f"checkpoint.folder={folder}", "checkpoint.interval=4", "checkpoint.keep_latest_k=0"]
    args = files_run(corpus, *layout.split(), "launcher.nproc_per_node=2", "training.steps=10", *ckpt, uri)
    whole = run_cli(args, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-10", "step-4", "step-8"]  # and the last step
    whole_curve = loss_curve(db, mlflow_runs(db)[-1].info.run_id)
    assert (folder / "mlflow_run_id").read_text() == mlflow_runs(db)[-1].info.run_id
    assert b"dataloader" in (folder / "step-4" / ".metadata").read_bytes()  # where the stream was
    # As a job killed after step 10 leaves its run (a finished run's record is never reopened).
    mlflow_client(db).set_terminated(mlflow_runs(db)[-1].info.run_id, "KILLED")
    shutil.rmtree(folder / "step-10")
    shard = next((folder / "step-8").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # the newest checkpoint left cut short: the one before is taken
    resumed = run_cli(args, tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{folder}/step-8 cannot be read" in resumed.stdout and f"resumed from {folder}/step-4" in resumed.stdout
    # The resumed job goes on in the run that saved the checkpoint: one run, FINISHED, whose steps
    # 5..10 were logged twice, each counted once in its curve (the resumed job's logging).
    [run] = mlflow_runs(db)
    assert run.info.status == "FINISHED" and "failure_reason" not in run.data.tags
    history = mlflow_client(db).get_metric_history(run.info.run_id, "loss/global_avg")
    relogged = sorted(m.step for m in history if sum(h.step == m.step for h in history) == 2)
    assert sorted(set(relogged)) == list(range(5, 11))
    latest = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
    assert loss_curve(db, run.info.run_id) == [latest[step] for step in range(1, 11)]
    assert [latest[step] for step in range(5, 11)] == pytest.approx(whole_curve[4:], rel=1e-6)


# Files a refusal is about, written into {dir}.
BAD_FILES = {
    "docs.csv": "text\nhello\n",
    "tokenizer.json": "{}",
    "tiny.jsonl": json.dumps({"text": "a fox"}) + "\n",
    "empty.jsonl": "",
    "broken.jsonl": "not json\n",
}


@pytest.mark.parametrize(
    "change,expected",
    [
        (["data.paths=[/nowhere/*.jsonl]"], "data.paths=/nowhere/*.jsonl: matches no file"),
        (["data.paths=[{dir}/*.csv]"], "which is not .txt, .jsonl, .parquet or a saved dataset folder"),
        (["data.text_field=body"], "data.text_field=body: {corpus}/docs.jsonl's records have id, text; name one"),
        (["data.paths=[{dir}/broken.jsonl]"], "broken.jsonl: record 0 is not JSON"),
        (["data.tokenizer_path=/nowhere/tokenizer.json"], "data.tokenizer_path=/nowhere/tokenizer.json: no such file"),
        (["data.tokenizer_path={dir}/tokenizer.json"], "not a tokenizer.json that the tokenizers library reads"),
        (["model.vocab_size=256"], "token ids exceed model.vocab_size=256"),
        (["data.paths=[{dir}/tiny.jsonl]"], "tokens, fewer than one window of training.seq_len+1=33"),
        (["data.paths=[{dir}/empty.jsonl]"], "the train split's documents hold 0 tokens"),
        (
            ["validation.enable=true", "validation.held_out_fraction=0.001"],
            "validation.held_out_fraction=0.001: the validation split's documents hold 0 tokens",
        ),
        (
            ["validation.enable=true", "validation.paths=[{dir}/tiny.jsonl]"],
            "validation.paths=[{dir}/tiny.jsonl]: the validation split's documents hold",
        ),
    ],
)
def test_bad_files_or_tokenizers_are_refused_before_any_rank_starts(corpus, tmp_path, change, expected):
    for name, text in BAD_FILES.items():
        (tmp_path / name).write_text(text)
    where = {"dir": tmp_path, "corpus": corpus[0]["jsonl"].parent}
    change = [c.format(**where) for c in change]
    done = run_cli([*files_run(corpus, "parallelism=single", "tracking=none"), *change], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert expected.format(**where) in line


def test_the_text_corpus_takes_a_given_tokenizer_too(corpus, tmp_path):
    files, tokenizer = corpus
    config = DataConfig(corpus_path=str(files["txt"]), tokenizer_path=str(tokenizer), cache_dir=str(tmp_path))
    tokens = np.load(prepare_tokens(config))
    encoder = load_tokenizer(str(tokenizer))
    assert tokens.tolist() == [t for doc in load_documents(str(files["txt"])) for t in encoder.encode(doc)]
    assert not (prepare_tokens(config).parent / "tokenizer.json").exists()  # no BPE trained

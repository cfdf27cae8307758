"""The pre-flight: what a resolved job needs from this machine, checked once before any process is
spawned (or any store written): folders it writes, files it reads, the tracking store, and one
rank's estimated peak memory against what each rank can have. Each refusal is a ConfigError (one
line, exit 2), like the config's own rules (config/check.py)."""

import codecs
import contextlib
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from titan_exp.checkpoint.config import OWN_FOLDER
from titan_exp.checkpoint.layout import (
    DCP_METADATA,
    NotEnoughSpaceError,
    check_folder,
    check_free_space,
    check_step_files,
    folder_bytes,
    latest_step,
    run_id_beside,
    step_dir,
)
from titan_exp.checkpoint.model_record import check_data_position, check_same_model
from titan_exp.checkpoint.staging import own_file
from titan_exp.config.job import ResolvedJob
from titan_exp.config.schema import JobConfig
from titan_exp.data.documents import SAVED_DATASET_MARK, SUFFIXES, expand, first_record_fields
from titan_exp.data.files import FilesSource, TooFewTokensError
from titan_exp.data.tokenizer import load_tokenizer
from titan_exp.data.tokenizer_trial import try_tokenizer
from titan_exp.estimate.workload import model_parameters
from titan_exp.job.memory import Budget, check_memory_fit
from titan_exp.models.hf_tensors import check_hf_checkpoint
from titan_exp.models.registry import config_from_hf, family_of
from titan_exp.rules import ConfigError
from titan_exp.tracking.config import Store
from titan_exp.tracking.journal import MAX_RUN_ID_BYTES, is_run_id
from titan_exp.tracking.store import not_a_store, read_only, server_answers

# How long a tracking server has to answer its health endpoint before the job is refused.
SERVER_ANSWER_S = 3.0


def preflight(job: ResolvedJob, memory: bool = True) -> None:
    """Everything below, in order; `memory=False` leaves out what the run would need of this
    machine's memory and disk (the planner predicts for another machine instead)."""
    cfg = job.config
    _writable_folder("data.cache_dir", cfg.data.cache_dir)  # tokenized corpora, the measured CPU peak FLOP/s
    if cfg.data.source == "text" and cfg.data.corpus_path is not None:
        _text_file("data.corpus_path", Path(cfg.data.corpus_path))
    if cfg.data.tokenizer_path is not None:
        _tokenizer_file(cfg)
    if cfg.data.source == "files":
        _document_files("data.paths", cfg.data.paths, cfg.data.text_field)
        if cfg.validation.enable and cfg.validation.paths:
            _document_files("validation.paths", cfg.validation.paths, cfg.data.text_field)
        _one_window_each(cfg)
    _checkpoint_folders(cfg, room=memory and not job.dry_run)
    if job.store is not None:
        _reachable_store(job.store)
        if cfg.tracking.parent_run_id:
            _parent_run_exists(job.store, cfg.tracking.parent_run_id)
    if memory and not job.dry_run:
        _memory_fits(job)


def _text_file(key: str, path: Path) -> None:
    """A file that holds UTF-8 text, by its first bytes (a corpus may be large)."""
    fix = "point it at a UTF-8 text file or set it to null"
    if not path.is_file():
        raise ConfigError(key, path, f"no such file; {fix}")
    with open(path, "rb") as file:
        head = file.read(1 << 16)
    if not head.strip():
        raise ConfigError(key, path, f"the file is empty; {fix}")
    try:  # an incremental decoder accepts a character cut at the end of the chunk
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as err:
        raise ConfigError(key, path, f"not UTF-8 text (byte {err.start}); {fix}") from None
    if "\x00" in text:
        raise ConfigError(key, path, f"a binary file (it holds NUL bytes); {fix}")


def _tokenizer_file(cfg: JobConfig) -> None:
    """A tokenizer.json the tokenizers library reads, with an end-of-document token, whose ids the
    model's embedding holds."""
    fix = "pick a model whose vocabulary holds them (or raise model.vocab_size)"
    check_tokenizer("data.tokenizer_path", cfg.data.tokenizer_path, cfg.model.vocab_size, fix)


def check_tokenizer(key: str, path: str, vocab: int, fix: str) -> None:
    """The tokenizer.json `path` (named by `key`) is one the tokenizers library reads, with an
    end-of-document token, and a model of `vocab` ids holds its ids (else `fix`). It is tried in a
    child process first: the library may need more memory than this process may take, or panic."""
    if not Path(path).exists():
        raise ConfigError(key, path, "no such file; point it at a tokenizer.json")
    try:
        try_tokenizer(path)
        tokenizer = load_tokenizer(path)
    except ValueError as err:
        raise ConfigError(key, path, str(err)) from None
    if (size := tokenizer.vocab_size) > vocab:
        largest = tokenizer.tokenizer.id_to_token(size - 1)
        raise ConfigError(
            key, path, f"its {size} token ids exceed model.vocab_size={vocab} ({largest!r} is id {size - 1}); {fix}"
        )


def _document_files(key: str, globs: list[str], text_field: str) -> None:
    """Every glob matches something this project reads, whose records hold `text_field` (judged by
    the first record of each file: a corpus may be large)."""
    for pattern in globs:
        matches = expand([pattern])
        if not matches:
            raise ConfigError(key, pattern, "matches no file; check the path (globs like data/*.jsonl are fine)")
        for path in matches:
            saved = path.is_dir() and (path / SAVED_DATASET_MARK).is_file()
            if not saved and path.suffix not in SUFFIXES:
                kinds = ", ".join(SUFFIXES)
                raise ConfigError(key, pattern, f"matches {path}, which is not {kinds} or a saved dataset folder")
            try:
                fields = first_record_fields(path)
            except ValueError as err:
                raise ConfigError(key, pattern, str(err)) from None
            if fields is not None and text_field not in fields:
                raise ConfigError(
                    "data.text_field", text_field, f"{path}'s records have {', '.join(fields) or 'no fields'}; name one"
                )
            if fields is not None and not fields[text_field]:
                texts = ", ".join(name for name, is_text in fields.items() if is_text) or "none"
                raise ConfigError(
                    "data.text_field",
                    text_field,
                    f"{path}'s first record holds no text there (fields with text: {texts})",
                )


def _one_window_each(cfg: JobConfig) -> None:
    """Each split's documents fill one window of training.seq_len+1 tokens, read only until they do
    (through the source the ranks read)."""
    v = cfg.validation
    held_out, given = (v.held_out_fraction, list(v.paths)) if v.enable else (0.0, [])
    for split in ("train", "validation") if v.enable else ("train",):
        key, globs = ("validation.paths", given) if split == "validation" and given else ("data.paths", cfg.data.paths)
        try:
            FilesSource(cfg.data, cfg.training.seq_len, cfg.debug.seed, split, held_out, given).samples([0])
        except TooFewTokensError as err:
            if split == "validation" and not given:  # the hashed share of data.paths
                raise ConfigError("validation.held_out_fraction", held_out, str(err)) from None
            raise ConfigError(key, f"[{','.join(globs)}]", str(err)) from None
        except ValueError as err:  # a record that cannot be read
            raise ConfigError(key, f"[{','.join(globs)}]", str(err)) from None


def _checkpoint_folders(cfg: JobConfig, room: bool) -> None:
    """Folders that can be written, a resume with steps left, an initial load that is a checkpoint;
    `room`: and the space for one checkpoint."""
    c = cfg.checkpoint
    # A job that is not run (show) has no folder of its own yet.
    saves = (c.enable or c.create_seed_checkpoint) and c.folder != OWN_FOLDER
    if saves:
        _writable_folder("checkpoint.folder", c.folder)
        _checkpoint_entries(c.folder)
    resumes_at = latest_step(c.folder) if saves and c.enable else None
    if room and saves:
        _room_for_a_checkpoint(cfg, resumes_at)
    if resumes_at is not None and resumes_at >= cfg.training.steps:
        raise ConfigError(
            "training.steps",
            cfg.training.steps,
            f"checkpoint.folder={c.folder} holds step-{resumes_at} already, so nothing is left to train; "
            "raise training.steps or point checkpoint.folder elsewhere",
        )
    if resumes_at is not None:
        _step_files("checkpoint.folder", step_dir(c.folder, resumes_at))
        check_same_model(step_dir(c.folder, resumes_at), cfg.model, "checkpoint.folder")
        check_data_position(step_dir(c.folder, resumes_at), needed=cfg.data.source == "files")
    if c.initial_load_in_hf:
        _hf_checkpoint(cfg, c.initial_load_path, "checkpoint.initial_load_path")
    elif c.initial_load_path is not None:
        if not (Path(c.initial_load_path) / DCP_METADATA).is_file():
            raise ConfigError(
                "checkpoint.initial_load_path",
                c.initial_load_path,
                "not a checkpoint folder (no .metadata); point it at a step-N folder, e.g. a seed checkpoint's step-0",
            )
        _step_files("checkpoint.initial_load_path", Path(c.initial_load_path))
        check_same_model(Path(c.initial_load_path), cfg.model, "checkpoint.initial_load_path")


def _checkpoint_entries(folder: str) -> None:
    """Nothing in checkpoint.folder that a save would write through or a resume read for ever: its
    steps are folders a save left (no links), its run-id file a regular file of a run id's size."""
    try:
        check_folder(folder)
        run_id = run_id_beside(folder)
        if os.path.lexists(run_id) and (size := own_file(run_id)) > MAX_RUN_ID_BYTES:
            raise ValueError(f"{run_id} is {size:,} bytes, not an MLflow run id")
        if os.path.lexists(run_id) and not is_run_id(text := run_id.read_text(errors="replace").strip()):
            raise ValueError(f"{run_id} holds {text[:40]!r}, not an MLflow run id")  # printed later: no escapes
    except ValueError as err:
        fix = "remove it or point checkpoint.folder elsewhere"
        raise ConfigError("checkpoint.folder", folder, f"{err}; {fix}") from None


def _step_files(key: str, step_folder: Path) -> None:
    """The step's files a rank reads are regular files, no links (a FIFO would block it for ever)."""
    try:
        check_step_files(step_folder)
    except ValueError as err:
        raise ConfigError(key, str(step_folder), f"{err}; point {key} elsewhere") from None


def _hf_checkpoint(cfg: JobConfig, folder: str, key: str) -> None:
    """A Hugging Face folder of the job's model: its family's, the same shape, every tensor there."""
    theirs = config_from_hf(folder, key)
    if theirs.name != cfg.model.name:
        raise ConfigError(
            key, folder, f"holds a {theirs.name} model, not {cfg.model.name}; add model=hf model.hf_path={folder}"
        )
    check_hf_checkpoint(cfg.model, theirs, family_of(cfg.model).hf, folder, key)


def _room_for_a_checkpoint(cfg: JobConfig, resumes_at: int | None) -> None:
    """Free space for one checkpoint in checkpoint.folder (a save checks again before it writes):
    the size of the step a resumed run saved, or the model's fp32 weights and, when training,
    AdamW's two fp32 moments."""
    c = cfg.checkpoint
    if resumes_at is not None:
        needed = folder_bytes(step_dir(c.folder, resumes_at))
    else:
        needed = model_parameters(cfg.model) * (4 if c.create_seed_checkpoint else 12)
    try:
        check_free_space(c.folder, needed)
    except NotEnoughSpaceError as err:
        raise ConfigError("checkpoint.folder", c.folder, str(err)) from None


def _writable_folder(key: str, folder: str, value: str | None = None) -> None:
    """A folder a file can be written in, found by trying (permission bits say little to root, or on
    /proc): the folder is made if missing, a file created and removed in it, and what was made for
    the try removed again."""
    if not folder:
        raise ConfigError(key, "''", "must name a folder")
    path = Path(folder).absolute()
    missing = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        fix = f"cannot write there ({err.strerror}); point it at a folder you can write"
        raise ConfigError(key, value or folder, fix) from None
    finally:
        for made in missing:  # deepest first
            with contextlib.suppress(OSError):
                made.rmdir()


def _reachable_store(store: Store) -> None:
    """A store the job can write, found before any rank starts (a job that trains to the end and
    records nothing costs its whole run): a SQLite file that is a database, in a folder that can be
    written, or a server that answers."""
    if store.is_server:
        if down := server_answers(store.uri, SERVER_ANSWER_S):
            raise ConfigError(
                "tracking.uri",
                store.uri,
                f"{down}; start one (mlflow server --backend-store-uri sqlite:///mlflow.db --port PORT) "
                "or use a sqlite:/// store",
            )
        return
    _writable_folder("tracking.uri", str(store.db.parent), store.uri)
    if why := not_a_store(store.db):
        raise ConfigError("tracking.uri", store.uri, why)


def _parent_run_exists(store: Store, run_id: str) -> None:
    """The run a job is to be a child of is in its store (MLflow would take any id, and the job's
    run would hang under nothing)."""
    if store.is_server:
        url = f"{store.uri.rstrip('/')}/api/2.0/mlflow/runs/get?{urllib.parse.urlencode({'run_id': run_id})}"
        try:
            with urllib.request.urlopen(url, timeout=SERVER_ANSWER_S):
                return
        except urllib.error.HTTPError as err:
            found = err.code != 404
        except OSError:  # it answered its health check a moment ago: let the run's writer retry
            return
    elif store.db.exists():
        with read_only(store.db) as db:
            found = db.execute("SELECT 1 FROM runs WHERE run_uuid = ?", (run_id,)).fetchone() is not None
    else:
        found = False
    if not found:
        raise ConfigError(
            "tracking.parent_run_id", run_id, f"no such run in {store.uri}; give the id of a run there, or drop it"
        )


def _memory_fits(job: ResolvedJob) -> None:
    """One rank's estimated peak within what each rank can have, where its engine knows that before
    the ranks start (launchers/: a GPU's memory, the available memory our local CPU ranks share, a
    Slurm CPU job's launcher.mem_gb per node; job/memory.py)."""
    placement = job.placement
    if placement.started_by != job.config.launcher.name:  # torchrun or srun: siblings already allocating
        return
    budget = job.launcher.memory_budget(placement)
    if budget is not None:
        check_memory_fit(job, Budget.of(job.config, budget.bytes, budget.shared, budget.what), placement.device)

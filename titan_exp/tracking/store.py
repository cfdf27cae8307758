"""The MLflow store: where it is (URIs), creating it once, opening a client, and riding out a busy
SQLite store. MLflow itself is imported only when a client is opened or a store created (seconds
of start-up)."""

import contextlib
import errno
import fcntl
import logging
import os
import sqlite3
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from titan_exp.rules import ConfigError
from titan_exp.tracking.config import SQLITE_PREFIX, Store, TrackingConfig, masked
from titan_exp.untrusted import regular_file

# SQLite lets one writer in at a time; a busy store is retried for this long before giving up
# (long: a writer that holds the lock may wait for an idle core, see tracking/writer.py).
RETRY_SECONDS = 600.0

T = TypeVar("T")


def client(uri: str):
    """A client of the store at `uri`; a SQLite store is created first (create_store), since MLflow
    would create it in place, racing any other process that opens it."""
    from mlflow.tracking import MlflowClient

    if (db := Store.parse(uri).db) is not None:
        create_store(db)
    _quiet_about_busy_store()
    # MLflow draws a progress bar on stderr for every artifact download, however small (`plan
    # calibrate` reads one file a run: a bar each around its table); a user's own setting stands.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return with_retries(lambda: MlflowClient(tracking_uri=uri))  # it reads the tables: a busy store is retried


# MLflow's SQL store logs a traceback for every "database is locked" before raising it; with_retries
# retries those, so a retry that succeeds would print tracebacks for nothing. One that gives up
# raises the error itself.
_BUSY_STORE_LOGGER = "mlflow.store.db.utils"


def _quiet_about_busy_store() -> None:
    busy_store_logger = logging.getLogger(_BUSY_STORE_LOGGER)
    if _drop_busy_store_records not in busy_store_logger.filters:
        busy_store_logger.addFilter(_drop_busy_store_records)


def _drop_busy_store_records(record: logging.LogRecord) -> bool:
    return not is_store_busy(Exception(record.getMessage()))


def ensure_store(cfg: TrackingConfig) -> None:
    """The SQLite store created (create_store) and, where this call created it, its experiment
    (rank 0 creates the experiment of a store that existed, if new). A server's store exists already."""
    if cfg.store.db is not None and create_store(cfg.store.db):
        experiment_id(client(cfg.uri), cfg)


# Alembic (under MLflow's SQL store) says at INFO which of its plugins it sets up as it is imported;
# under a sweeper that configures the root logger (Optuna's) those lines would fill the console.
logging.getLogger("alembic").setLevel(logging.WARNING)


def create_store(db: Path) -> bool:
    """Create the SQLite store `db` (MLflow's tables, all its migrations) unless it exists; True if
    this call created it. Safe against any other process opening `db` at the same moment: MLflow
    migrates a store without tables in place, and two processes doing so fail ("table runs already
    exists", "duplicate column name"). So it is made in a file beside `db`, under an exclusive lock,
    and renamed into place: any process sees no file or a complete store. An existing store is left
    alone without importing MLflow (seconds of start-up)."""
    if db.exists():
        return False
    db.parent.mkdir(parents=True, exist_ok=True)
    with _locked(db):
        if db.exists():  # made by the process that held the lock before
            return False
        draft = db.with_name(db.name + ".creating")
        try:
            for stale in (draft, draft.with_name(draft.name + "-journal")):  # a killed creation's left
                stale.unlink(missing_ok=True)
            _migrate(draft)
            os.replace(draft, db)
        finally:
            draft.unlink(missing_ok=True)
    return True


@contextlib.contextmanager
def _locked(db: Path) -> Iterator[None]:
    """Held by one process at a time: an exclusive lock on the file beside `db`."""
    lock_path = db.with_name(db.name + ".lock")
    try:  # never through a link: one planted there would have us open (and lock) its target
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            uri = SQLITE_PREFIX + str(db)
            raise ConfigError("tracking.uri", uri, f"{lock_path} is a symbolic link; remove it") from None
        raise
    with os.fdopen(fd, "r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _migrate(path: Path) -> None:
    """MLflow's tables (and its Default experiment) in a new SQLite file at `path`, closed after."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = Store.parse(SQLITE_PREFIX + str(path))
    # MLflow says at INFO that it creates and updates the tables: every first run's console would.
    migration_log = logging.getLogger("mlflow.store.db.utils")
    level = migration_log.level
    migration_log.setLevel(logging.WARNING)
    try:
        # Its connections closed before the file is renamed: one left open would keep writing its
        # journal under the old name.
        SqlAlchemyStore(store.uri, store.artifact_location("Default")).engine.dispose()
    finally:
        migration_log.setLevel(level)


# MLflow 3's UI opens an experiment on the view its kind names; without the tag it guesses, and an
# experiment of training runs opened on the GenAI overview (traces, evaluations: all empty).
EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"


def experiment_id(mlflow_client, cfg: TrackingConfig) -> str:
    """The id of cfg.experiment, created if new, marked as a model-training experiment (also one
    created before the mark existed, once)."""
    experiment = mlflow_client.get_experiment_by_name(cfg.experiment)
    if experiment:
        if experiment.tags.get(EXPERIMENT_KIND_TAG) is None:
            with_retries(
                lambda: mlflow_client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
            )
        return experiment.experiment_id
    location = cfg.store.artifact_location(cfg.experiment)
    try:
        kind = {EXPERIMENT_KIND_TAG: MODEL_TRAINING}
        return mlflow_client.create_experiment(cfg.experiment, artifact_location=location, tags=kind)
    except Exception:
        # Another job created it in the meantime.
        experiment = mlflow_client.get_experiment_by_name(cfg.experiment)
        if experiment is None:
            raise
        return experiment.experiment_id


def server_answers(uri: str, timeout_s: float = 3.0) -> str | None:
    """None if the tracking server at `uri` answers its health endpoint within `timeout_s`, else why not."""
    health = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=timeout_s) as answer:
            answer.read()
    except (OSError, ValueError) as err:
        why = getattr(err, "reason", None) or err
        return f"no MLflow server answers at {masked(health)} within {timeout_s:g} s ({why})"
    return None


# Tables every MLflow SQL store has (an empty database gets them on first use).
MLFLOW_TABLES = {"alembic_version", "experiments", "runs", "metrics", "params", "tags"}


def not_a_store(db: Path) -> str | None:
    """Why the SQLite path `db` cannot be a store (not a regular file: a folder, a device such as
    /dev/null, a FIFO whose opening would block; a file that is not SQLite; another application's
    database), or None: an MLflow store, an empty file or database, or nothing there yet. Reads the
    header and the schema only, without MLflow."""
    if not db.exists() and not db.is_symlink():
        return None
    try:
        if regular_file(db) == 0:
            return None
    except ValueError as err:
        return f"{err}; name a SQLite database file"
    with open(db, "rb") as file:
        if file.read(16) != b"SQLite format 3\x00":  # SQLite's header
            return f"{db} is not a SQLite database (its first bytes say otherwise); name another file"
    try:
        with read_only(db) as conn:
            tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as err:
        if is_store_busy(err):  # another job is writing it: a store
            return None
        return f"{db} is not a readable SQLite database ({err}); move it away or name another file"
    if tables and not MLFLOW_TABLES <= tables:  # MLflow would add its tables to the other database
        return f"{db} is another application's SQLite database, not an MLflow store; name another file"
    return None


def read_only(db: Path) -> contextlib.closing[sqlite3.Connection]:
    """A connection that cannot change the store (nor create it)."""
    return contextlib.closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True, timeout=5))


def open_experiment(uri: str, experiment: str):
    """(client, experiment) of an existing store for a command that reads it (compare, plan
    calibrate); each way it cannot be opened is a ValueError saying so in one line, naming the flag."""
    try:
        store = Store.parse(uri)
    except ValueError as err:
        raise ValueError(f"--uri={masked(uri)}: {err}") from None
    if store.db is not None and not store.db.exists():
        raise ValueError(f"--uri={uri}: no MLflow store there; train something first or point --uri at your store")
    if store.db is not None and (why := not_a_store(store.db)):
        raise ValueError(f"--uri={uri}: {why}")
    mlflow_client = client(store.uri)
    found = mlflow_client.get_experiment_by_name(experiment)
    if found is None:
        raise ValueError(
            f"--experiment={experiment}: no such experiment in {masked(store.uri)}; "
            "pass the name you set as tracking.experiment"
        )
    return mlflow_client, found


def is_store_busy(err: Exception) -> bool:
    return "database is locked" in str(err)


def with_retries(call: Callable[[], T]) -> T:
    """`call()`, retried while a SQLite store is busy ("database is locked"); MLflow's REST client
    retries an unreachable server itself."""
    deadline = time.monotonic() + RETRY_SECONDS
    delay = 0.2
    while True:
        try:
            return call()
        except Exception as err:
            if not is_store_busy(err) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 5.0)

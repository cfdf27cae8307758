"""The MLflow store: where it is (URIs), creating it once, opening a client, and riding out a busy
SQLite store. MLflow itself is imported only when a client is opened (seconds of start-up)."""

import errno
import fcntl
import logging
import os
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from titan_exp.rules import ConfigError
from titan_exp.tracking.config import TrackingConfig, masked

# SQLite lets one writer in at a time; a busy store is retried for this long before giving up
# (long: a writer that holds the lock may wait for an idle core, see tracking/writer.py).
_RETRY_SECONDS = 600.0

T = TypeVar("T")


def client(uri: str):
    from mlflow.tracking import MlflowClient

    _quiet_about_busy_store()
    return MlflowClient(tracking_uri=uri)


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
    """Create a SQLite store (its migrations) and the experiment once, even when several launching
    processes start at the same moment: they take turns on a lock file, and a store that exists was
    completed under that lock. An existing store is left alone without importing MLflow (seconds of
    start-up); rank 0 creates the experiment if it is new. A server's store exists already."""
    db = cfg.store.db
    if db is None:
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    lock_path = db.with_name(db.name + ".lock")
    try:  # never through a link: one planted there would have us open (and lock) its target
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError("tracking.uri", cfg.uri, f"{lock_path} is a symbolic link; remove it") from None
        raise
    with os.fdopen(fd, "r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not db.exists():
            experiment_id(client(cfg.uri), cfg)


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


def not_a_store(db: Path) -> str | None:
    """Why the SQLite path `db` cannot be read as a store (a folder, a file that is not SQLite), or
    None (a store, an empty file, or nothing there yet)."""
    if db.exists() and not db.is_file():
        return f"{db} is not a file; name a SQLite database file"
    if not db.is_file() or db.stat().st_size == 0:
        return None
    with open(db, "rb") as file:
        if file.read(16) != b"SQLite format 3\x00":  # SQLite's header
            return f"{db} is not a SQLite database (its first bytes say otherwise); name another file"
    return None


def is_store_busy(err: Exception) -> bool:
    return "database is locked" in str(err)


def with_retries(call: Callable[[], T]) -> T:
    """`call()`, retried while a SQLite store is busy ("database is locked"); MLflow's REST client
    retries an unreachable server itself."""
    deadline = time.monotonic() + _RETRY_SECONDS
    delay = 0.2
    while True:
        try:
            return call()
        except Exception as err:
            if not is_store_busy(err) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 5.0)

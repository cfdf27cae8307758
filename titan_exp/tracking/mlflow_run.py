"""One MLflow run per training job, written by rank 0 only.

The launching process creates the store and the experiment before any rank starts (several
processes opening a brand-new SQLite store race in its migrations), then stays out of it unless the
ranks die: then it closes their run as FAILED with the reason. Rank 0 writes through a background
thread, so training never waits on the store.
"""

import getpass
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import traceback
from pathlib import Path
from urllib.parse import urlparse

from titan_exp.tracking.config import TrackingConfig

# MLflow's per-call limits for log_batch.
_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_LENGTH = 6000
_MAX_TAG_LENGTH = 5000


def absolute_uri(uri: str) -> str:
    """sqlite:///relative.db → sqlite:////abs/relative.db, so ranks started elsewhere find the same file."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def _sqlite_path(uri: str) -> Path | None:
    return Path(urlparse(uri).path) if uri.startswith("sqlite:///") else None


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def ensure_store(cfg: TrackingConfig) -> None:
    """Create the store (a new SQLite file runs its migrations) and the experiment, once."""
    db = _sqlite_path(cfg.uri)
    if db is not None and db.exists():
        return  # opened before: nothing to migrate; the experiment is checked by rank 0
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    _experiment_id(_client(cfg.uri), cfg)


def _experiment_id(client, cfg: TrackingConfig) -> str:
    experiment = client.get_experiment_by_name(cfg.experiment)
    if experiment:
        return experiment.experiment_id
    db = _sqlite_path(cfg.uri)
    # For a SQLite store artifacts go beside the database (MLflow would use ./mlruns of the cwd).
    location = (db.parent / "mlartifacts" / cfg.experiment).as_uri() if db else None
    return client.create_experiment(cfg.experiment, artifact_location=location)


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


class MlflowRun:
    def __init__(self, uri: str, run_id: str):
        self.client = _client(uri)
        self.run_id = run_id

    @classmethod
    def create(cls, cfg: TrackingConfig, run_name: str, tags: dict[str, str]) -> "MlflowRun":
        client = _client(cfg.uri)
        base_tags = {"hostname": socket.gethostname(), "user": getpass.getuser(), "git_commit": git_commit()}
        run = client.create_run(_experiment_id(client, cfg), run_name=run_name, tags={**base_tags, **tags})
        return cls(cfg.uri, run.info.run_id)

    def log_params(self, params: dict[str, object]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:_MAX_PARAM_LENGTH]) for k, v in params.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + _MAX_PARAMS_PER_BATCH])

    def log_metrics(self, step: int, metrics: dict[str, float], timestamp_ms: int) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), timestamp_ms, step) for k, v in metrics.items()])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def finish(self, status: str, reason: str | None = None) -> None:
        """status: FINISHED | FAILED | KILLED, also kept as the `status` tag (with `failure_reason`)."""
        self.client.set_tag(self.run_id, "status", status.lower())
        if reason:
            self.client.set_tag(self.run_id, "failure_reason", reason[:_MAX_TAG_LENGTH])
        self.client.set_terminated(self.run_id, status=status)


class BackgroundTracker:
    """Rank 0's writer. A thread creates the run, records its id in `run_id_file` for the launching
    process, then writes whatever the training loop queued, in order. A store that fails is reported
    once and training goes on without tracking.

    The thread is not a daemon: a rank that is interrupted (SIGINT) or raises still exits only once
    everything queued is written. The thread waits for `begin()` (the trainer calls it once the first step is done): importing
    MLflow and opening the store take seconds of Python work that would otherwise compete with the
    rank's own start-up for the interpreter lock.
    """

    def __init__(self, cfg: TrackingConfig, run_name: str, tags: dict[str, str], run_id_file: Path | None):
        self._queue: queue.Queue = queue.Queue()
        self._error: str | None = None
        self._go = threading.Event()
        self._thread = threading.Thread(
            target=self._work, args=(cfg, run_name, tags, run_id_file), name="mlflow-tracker"
        )
        self._thread.start()

    def log_params(self, params: dict[str, object]) -> None:
        self._queue.put(("log_params", (params,)))

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._queue.put(("log_metrics", (step, metrics, int(time.time() * 1000))))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._queue.put(("log_text", (text, artifact_file)))

    def begin(self) -> None:
        self._go.set()

    def close(self, status: str, reason: str | None = None) -> None:
        """Write everything queued, end the run with `status`, and wait for the thread."""
        self._go.set()
        self._queue.put(("finish", (status, reason)))
        self._queue.put(None)
        # The launcher interrupts the ranks of a failed job; finish writing first (its SIGKILL
        # after a grace period still bounds the wait).
        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
        try:
            self._thread.join()
        finally:
            if in_main_thread:
                signal.signal(signal.SIGINT, previous)
        if self._error:
            print(f"titan_exp: tracking failed, the run's MLflow record is incomplete: {self._error}", flush=True)

    def _work(self, cfg: TrackingConfig, run_name: str, tags: dict[str, str], run_id_file: Path | None) -> None:
        self._go.wait()
        try:
            run = MlflowRun.create(cfg, run_name, tags)
            if run_id_file is not None:
                run_id_file.write_text(run.run_id)
            print(f"MLflow run {run.run_id} ({run_name}) in {cfg.uri}", flush=True)
        except Exception:
            self._error = traceback.format_exc(limit=1).strip().splitlines()[-1]
            run = None
        while (item := self._queue.get()) is not None:
            if run is None:
                continue  # drain, so the training loop never blocks on a dead store
            method, args = item
            try:
                getattr(run, method)(*args)
            except Exception:
                self._error = self._error or traceback.format_exc(limit=1).strip().splitlines()[-1]


def close_run_from_outside(cfg: TrackingConfig, run_id_file: Path, run_name: str, tags: dict[str, str], status: str, reason: str) -> None:
    """The launching process's last word when the ranks died: end their run (or, if rank 0 never
    got to create one, a new run) with `status` and `reason`."""
    if run_id_file.exists():
        run = MlflowRun(cfg.uri, run_id_file.read_text().strip())
    else:
        run = MlflowRun.create(cfg, run_name, tags)
    run.finish(status, reason)

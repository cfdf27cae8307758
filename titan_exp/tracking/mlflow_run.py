"""One MLflow run per training job, written by rank 0 only.

The launching process creates the store and the experiment before any rank starts (several
processes opening a brand-new SQLite store race in its migrations), then stays out of it unless the
ranks die: then it closes their run as FAILED (KILLED if interrupted) with the reason. Rank 0
writes through a separate process (BackgroundTracker), so training never waits on the store.
"""

import contextlib
import fcntl
import getpass
import os
import queue
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from launchers import signals
from titan_exp.tracking.config import TrackingConfig

# MLflow's per-call limits for log_batch.
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAM_LENGTH = 6000
_MAX_TAG_LENGTH = 5000
# SQLite lets one writer in at a time; a busy store is retried for this long before giving up
# (long: a writer that holds the lock may wait for an idle core, see _run_only_on_idle_cores).
_RETRY_SECONDS = 600.0
# The writer sends the metrics that arrived within this many seconds as one batch: every log step
# is recorded, with far fewer store transactions (each costs milliseconds of CPU) than one per step.
_METRICS_FLUSH_SECONDS = 2.0
# MLflow's tag that nests a run under another in the UI and in search.
PARENT_TAG = "mlflow.parentRunId"
# Set to "sweep" on a sweep's parent run, which trains nothing itself.
ROLE_TAG = "titan_exp.role"

T = TypeVar("T")
_STOP = ("stop", ())


def absolute_uri(uri: str) -> str:
    """sqlite:///relative.db → sqlite:////abs/relative.db, so ranks started elsewhere find the same file."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def sqlite_path(uri: str) -> Path | None:
    """sqlite:///rel.db → rel.db, sqlite:////abs.db → /abs.db (not urlparse: it keeps '//abs.db',
    which pathlib keeps too, and file URIs made from it lose their first directory)."""
    prefix = "sqlite:///"
    return Path(uri[len(prefix):]) if uri.startswith(prefix) else None


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def ensure_store(cfg: TrackingConfig) -> None:
    """Create a SQLite store (its migrations) and the experiment once, even when several launching
    processes start at the same moment: they take turns on a lock file, and a store that exists was
    completed under that lock. An existing store is left alone without importing MLflow (seconds of
    start-up); rank 0 creates the experiment if it is new. A server's store exists already."""
    db = sqlite_path(cfg.uri)
    if db is None:
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not db.exists():
            experiment_id(client(cfg.uri), cfg)


def experiment_id(mlflow_client, cfg: TrackingConfig) -> str:
    experiment = mlflow_client.get_experiment_by_name(cfg.experiment)
    if experiment:
        return experiment.experiment_id
    db = sqlite_path(cfg.uri)
    # For a SQLite store artifacts go beside the database (MLflow would use ./mlruns of the cwd).
    location = (db.resolve().parent / "mlartifacts" / cfg.experiment).as_uri() if db else None
    try:
        return mlflow_client.create_experiment(cfg.experiment, artifact_location=location)
    except Exception:
        # Another job created it in the meantime.
        experiment = mlflow_client.get_experiment_by_name(cfg.experiment)
        if experiment is None:
            raise
        return experiment.experiment_id


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


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def origin_tags() -> dict[str, str]:
    """Where and from which code a run was made."""
    return {"hostname": socket.gethostname(), "user": getpass.getuser(), "git_commit": git_commit()}


class MlflowRun:
    def __init__(self, uri: str, run_id: str):
        self.client = client(uri)
        self.run_id = run_id

    @classmethod
    def create(cls, cfg: TrackingConfig, run_name: str, tags: dict[str, str]) -> "MlflowRun":
        mlflow_client = client(cfg.uri)
        tags = {**origin_tags(), **tags}
        if cfg.parent_run_id:
            tags[PARENT_TAG] = cfg.parent_run_id
        run = with_retries(lambda: mlflow_client.create_run(experiment_id(mlflow_client, cfg), run_name=run_name, tags=tags))
        return cls(cfg.uri, run.info.run_id)

    def log_params(self, params: dict[str, object]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:_MAX_PARAM_LENGTH]) for k, v in params.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            with_retries(lambda: self.client.log_batch(self.run_id, params=items[i : i + _MAX_PARAMS_PER_BATCH]))

    def log_metrics(self, records: list[tuple[int, dict[str, float], int]]) -> None:
        """records: (step, {name: value}, timestamp in ms), written in as few calls as MLflow allows."""
        from mlflow.entities import Metric

        items = [Metric(k, float(v), timestamp, step) for step, metrics, timestamp in records for k, v in metrics.items()]
        for i in range(0, len(items), _MAX_METRICS_PER_BATCH):
            with_retries(lambda: self.client.log_batch(self.run_id, metrics=items[i : i + _MAX_METRICS_PER_BATCH]))

    def log_text(self, text: str, artifact_file: str) -> None:
        with_retries(lambda: self.client.log_text(self.run_id, text, artifact_file))

    def log_artifact(self, path: Path, artifact_dir: str) -> None:
        with_retries(lambda: self.client.log_artifact(self.run_id, str(path), artifact_dir))

    def set_tag(self, key: str, value: str) -> None:
        with_retries(lambda: self.client.set_tag(self.run_id, key, value[:_MAX_TAG_LENGTH]))

    def finish(self, status: str, reason: str | None = None) -> None:
        """status: FINISHED | FAILED | KILLED, also kept as the `status` tag (with `failure_reason`)."""
        self.set_tag("status", status.lower())
        if reason:
            self.set_tag("failure_reason", reason)
        with_retries(lambda: self.client.set_terminated(self.run_id, status=status))


class BackgroundTracker:
    """Rank 0's writer: a separate process, started before the rank imports torch, creates the
    run, records its id in `run_id_file` for the launching process, then writes what the training
    loop queues, in order, the metrics of every ~2 s in one batch. A store that fails is reported
    once and training goes on untracked.

    Why a process and not a thread: MLflow's client is pure Python (SQLAlchemy, HTTP) and a thread
    running it holds the interpreter lock that the training loop needs between every two torch ops;
    measured on CPU ranks, steps ran ~8× slower while a tracker thread imported MLflow.

    When it runs: its start-up (MLflow's import, opening the store, creating the run: 2-3
    CPU-seconds) at normal priority, alongside the rank's own (importing torch, building the model),
    so that it is done before training's first step; from the first metrics on, only on idle cores
    (measured on 2 CPU ranks that keep both cores busy: a start-up that spilled into the steps at
    idle priority cost 5-7% of their tokens/s). On GPU nodes, with cores to spare, neither matters.
    Metric timestamps are taken when they are queued. It dies with rank 0 (Linux), so a killed rank
    leaves no writer behind (our local launcher then closes the run; under torchrun or srun nothing
    does, and a SIGKILLed rank 0 leaves it RUNNING).
    """

    def __init__(self, cfg: TrackingConfig, run_name: str, tags: dict[str, str], run_id_file: Path | None):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copied torch or process-group state
        self._queue = context.Queue()
        self._process = context.Process(
            target=_write_run, args=(self._queue, cfg, run_name, tags, run_id_file, os.getpid()), name="mlflow-tracker", daemon=True
        )
        self._process.start()

    def log_params(self, params: dict[str, object]) -> None:
        self._queue.put(("log_params", (params,)))

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._queue.put(("log_metrics", ([(step, metrics, int(time.time() * 1000))],)))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._queue.put(("log_text", (text, artifact_file)))

    def log_artifact(self, path: Path, artifact_dir: str) -> None:
        self._queue.put(("log_artifact", (path, artifact_dir)))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The writer stopped while inside (for a measurement that needs the core to itself)."""
        os.kill(self._process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self._process.pid, signal.SIGCONT)

    def close(self, status: str, reason: str | None = None) -> None:
        """Write everything queued, end the run with `status`, and wait for the writer."""
        os.kill(self._process.pid, signal.SIGCONT)  # in case an interrupt came between pause and resume
        self._queue.put(("finish", (status, reason)))
        self._queue.put(_STOP)
        with interrupts_ignored():
            self._process.join()
        # The writer read everything up to the stop marker, or died: either way nothing is left
        # for the queue's feeder thread to deliver, and exit must not wait on it.
        self._queue.cancel_join_thread()


def interrupts_ignored() -> contextlib.AbstractContextManager[None]:
    """The launcher interrupts the ranks of a failed job (SIGINT; torchrun and Slurm: SIGTERM), more
    than once: what is being written then is finished first (the launcher's SIGKILL after a grace
    period bounds the wait)."""
    return signals.ignored(signal.SIGINT, signal.SIGTERM)


def _write_run(calls, cfg: TrackingConfig, run_name: str, tags: dict[str, str], run_id_file: Path | None, parent_pid: int) -> None:
    """The writer process's body."""
    _die_with_parent(parent_pid)
    # Launchers signal the whole process group (torchrun, Slurm: SIGTERM; Ctrl-C: SIGINT): the rank
    # decides when writing ends (close), and the writer dies with it anyway.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    error, monitor = None, None
    try:
        run = MlflowRun.create(cfg, run_name, tags)
    except Exception:
        error, run = _last_line(traceback.format_exc()), None
    if run is not None:
        if run_id_file is not None:
            run_id_file.write_text(run.run_id)
        print(f"MLflow run {run.run_id} ({run_name}) in {cfg.uri}", flush=True)
        monitor = _start_system_metrics(cfg, run.run_id) if cfg.system_metrics else None
    training = False
    for method, args in _batches(calls):
        if method == "log_metrics" and not training:
            training = True
            _run_only_on_idle_cores()  # see BackgroundTracker
        if run is None:
            continue  # drain, so the training loop's queue never fills up
        if method == "finish" and monitor is not None:
            _stop_system_metrics(monitor)
        try:
            getattr(run, method)(*args)
        except Exception as err:
            error = error or _last_line(traceback.format_exc())
            if is_store_busy(err):
                run = None  # busy past the retry window: give up rather than wait that long per call
    if error:
        print(f"titan_exp: tracking failed, the run's MLflow record is incomplete: {error}", flush=True)


def _batches(calls):
    """The queued calls in order until the stop marker; log_metrics calls that arrive within
    _METRICS_FLUSH_SECONDS of each other are merged into one."""
    pending = None
    while True:
        item, pending = pending or calls.get(), None
        if item == _STOP:
            return
        if item[0] == "log_metrics":
            records = list(item[1][0])
            deadline = time.monotonic() + _METRICS_FLUSH_SECONDS
            while (wait := deadline - time.monotonic()) > 0:
                try:
                    pending = calls.get(timeout=wait)
                except queue.Empty:
                    break
                if pending[0] != "log_metrics":
                    break  # a finish or an artifact: write what came before it now
                records += pending[1][0]
                pending = None
            item = ("log_metrics", (records,))
        yield item


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when the rank that started it dies (PR_SET_PDEATHSIG),
    and leave at once if it died before the request was made."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the writer then outlives a killed rank until its queue is drained
    if os.getppid() != parent_pid:
        os._exit(0)


def _run_only_on_idle_cores() -> None:
    """Linux's SCHED_IDLE for every thread of this process (the policy is per thread; threads
    started later inherit it): it runs only on a core nothing else wants and yields at once when a
    rank wakes up (stronger than nice 19, whose time slices still delay the ranks' collectives).
    Elsewhere it keeps the normal priority."""
    try:
        for thread_id in os.listdir("/proc/self/task"):
            os.sched_setscheduler(int(thread_id), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _last_line(formatted_traceback: str) -> str:
    return formatted_traceback.strip().splitlines()[-1]


def _start_system_metrics(cfg: TrackingConfig, run_id: str):
    """MLflow's system-metrics sampler for the run; None (reported) if it cannot start."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=cfg.system_metrics_interval_s, tracking_uri=cfg.uri)
        monitor.start()
        return monitor
    except Exception as err:
        print(f"titan_exp: system metrics are off: {type(err).__name__}: {err}", flush=True)
        return None


def _stop_system_metrics(monitor) -> None:
    """Stop sampling, then take one last sample, so that a run shorter than the interval has one
    too (MLflow's monitor drops the sample it took when it is told to stop). Best effort: the run
    is finished whatever happens here."""
    try:
        monitor.finish()
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()
    except Exception as err:
        print(f"titan_exp: last system metrics sample lost: {type(err).__name__}: {err}", flush=True)


def outcome(err: BaseException) -> tuple[str, str]:
    """(MLflow status, failure reason) of a run that `err` ended: KILLED when interrupted, else FAILED."""
    status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
    return status, f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def close_run_from_outside(cfg: TrackingConfig, run_id_file: Path, run_name: str, tags: dict[str, str], err: BaseException) -> None:
    """The launching process's last word when the ranks died of `err`: end their run (or, if rank
    0 never got to create one, a new run) with the status and reason `err` implies."""
    status, reason = outcome(err)
    if run_id_file.exists():
        run = MlflowRun(cfg.uri, run_id_file.read_text().strip())
    else:
        run = MlflowRun.create(cfg, run_name, tags)
    run.finish(status, reason)

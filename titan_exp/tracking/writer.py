"""Rank 0's MLflow writer: a separate process that creates the job's run and writes what the training
loop queues, so that training never waits on the store (see BackgroundTracker for why a process and
when it runs)."""

import contextlib
import ctypes
import gc
import multiprocessing
import os
import queue
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from launchers import signals
from titan_exp.tracking.config import TrackingConfig, masked
from titan_exp.tracking.journal import Journal
from titan_exp.tracking.run import MlflowRun, claim, now_ms, owner_tag, write_run_id
from titan_exp.tracking.store import RETRY_SECONDS, is_store_busy
from titan_exp.tracking.system_metrics import start_system_metrics, stop_system_metrics

# Launchers signal every process of a job, not only the ranks: Ctrl-C (SIGINT), torchrun, scancel
# and Slurm's time limit (SIGTERM), Slurm's warning ahead of the limit or a preemption (SIGUSR2,
# whose default action is to terminate). Rank 0 decides what they mean for its run.
JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
# The writer sends the metrics that arrived within this many seconds as one batch: every log step
# is recorded, with far fewer store transactions (each costs milliseconds of CPU) than one per step.
_METRICS_FLUSH_SECONDS = 2.0
_STOP = ("stop", ())
# The writer's exit status when the store did not take everything.
_EXIT_INCOMPLETE = 3


class BackgroundTracker:
    """Rank 0's writer: a separate process creates the run, records its id in `run_id_files` (for
    the launching process, and beside the job's checkpoints for a later resume), then writes what
    the training loop queues, in order, the metrics of every ~2 s in one batch. A store that fails
    is reported once and training goes on untracked.

    Why a process and not a thread: MLflow's client is pure Python (SQLAlchemy, HTTP) and a thread
    running it holds the interpreter lock that the training loop needs between every two torch ops;
    measured on CPU ranks, steps ran ~8× slower while a tracker thread imported MLflow.

    When it runs: its start-up (MLflow's import, opening the store, creating the run: ~2.7
    CPU-seconds) at normal priority, from the first metrics on only on idle cores (on 2 CPU ranks
    that keep both cores busy, a start-up that spilled into the steps at idle priority cost 5-7% of
    their tokens/s). Where the node has cores to spare (GPU nodes) it starts at once, beside the
    rank's own start-up (importing torch, building the model). Where the ranks take every core
    (`defer_start`), it starts when `start()` is called, after the first step: started with the rank
    it delayed that step by ~1.2 s on 2 CPU ranks; after it, it takes a few steps' time instead, and
    the run appears in the store a few seconds later. Everything queued meanwhile waits in the queue
    (and the journal). Metric timestamps are taken when they are queued. It dies with rank 0 (Linux),
    so a killed rank leaves no writer behind (our local launcher then closes the run; under torchrun
    or srun nothing does, and a SIGKILLed rank 0 leaves it RUNNING).
    """

    def __init__(
        self,
        cfg: TrackingConfig,
        run_name: str,
        tags: dict[str, str],
        run_id_files: tuple[Path, ...],
        resume_run_id: str | None = None,
        journal_file: Path | None = None,
        defer_start: bool = False,
    ):
        """`resume_run_id`: go on writing that (unfinished) run instead of creating one, e.g. after
        the job was requeued. `journal_file`: where every call is recorded before it is queued
        (tracking/journal.py). `defer_start`: the writer starts at `start()` (or `close()`)."""
        self._close_timeout_s = cfg.close_timeout_s
        self._journal = Journal(journal_file) if journal_file else None
        created = {"uri": cfg.uri, "experiment": cfg.experiment, "parent_run_id": cfg.parent_run_id}
        # The run starts now, whenever the writer gets to create it. `owner`: this job's token (run.py).
        created |= {"run_name": run_name, "tags": tags, "resume_run_id": resume_run_id, "start_ms": now_ms()}
        created["owner"] = secrets.token_hex(16)
        self._record("create", created)
        # The run names this very journal as one `sync` may replay into it (run.py); not journaled:
        # what the journal says is no claim (a copy says the same).
        claims = claim(journal_file) if journal_file else {}
        # What the store did not take, once closed (None: it took everything).
        self.incomplete: str | None = None
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copied torch or process-group state
        # Started with the job-wide signals ignored, which the writer and multiprocessing's resource
        # tracker (started with the queue) keep across exec: they die with rank 0 instead.
        with signals.ignored(*JOB_SIGNALS):
            self._queue = context.Queue()
            # Set (to 1) by the writer once its start-up is over. A flag without a lock: an Event's
            # lock, held by a writer killed at the wrong moment, would hang the training loop.
            self._idle = context.RawValue("b", 0)
            self._process = context.Process(
                target=_write_run,
                args=(self._queue, self._idle, cfg, created, claims, run_id_files, os.getpid()),
                name="mlflow-tracker",
                daemon=True,
            )
        if not defer_start:
            self.start()

    def start(self) -> None:
        """Start the writer process if it has not started yet."""
        if self._process.pid is None:
            with signals.ignored(*JOB_SIGNALS):
                self._process.start()

    def writer_idle(self) -> bool:
        """Whether the writer's start-up (MLflow's import, the run's creation) is over: until then
        it takes CPU from the ranks, so a throughput's steady state starts after it
        (metrics/throughput.py). (Not whether it is alive: asking reaps a dead writer, whose pid
        `close` and `paused` then cannot signal.)"""
        return bool(self._idle.value)

    def log_params(self, params: dict[str, object]) -> None:
        self._send("log_params", {key: str(value) for key, value in params.items()})

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._send("log_metrics", [(step, metrics, int(time.time() * 1000))])

    def log_text(self, text: str, artifact_file: str) -> None:
        self._send("log_text", text, artifact_file)

    def set_tag(self, key: str, value: str) -> None:
        self._send("set_tag", key, value)

    # Journaled absolute: `sync` reads a relative path as its job folder's, not this process's
    # working directory's (a sweep point's folder is relative to the sweep's).
    def log_artifact(self, path: Path, artifact_dir: str) -> None:
        self._send("log_artifact", os.path.abspath(path), artifact_dir)

    def log_artifacts(self, folder: Path, artifact_dir: str) -> None:
        """Every file under `folder`, under `artifact_dir` (as laid out there)."""
        self._send("log_artifacts", os.path.abspath(folder), artifact_dir)

    def _send(self, call: str, *args: object) -> None:
        """Journaled first, then queued for the writer."""
        self._record(call, *args)
        self._queue.put((call, args))

    def _record(self, call: str, *args: object) -> None:
        if self._journal is not None:
            self._journal.record(call, *args)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The writer stopped while inside (for a measurement that needs the core to itself)."""
        if self._process.pid is None:  # not started yet
            yield
            return
        os.kill(self._process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self._process.pid, signal.SIGCONT)

    def close(self, status: str | None, reason: str | None = None) -> None:
        """Write everything queued, end the run with `status` (None: leave it running, for a job that
        goes on later), and wait for the writer, at most tracking.close_timeout_s: a store that is
        down longer leaves the rest in the journal. Sets `incomplete` if the store did not take all."""
        self.start()  # a job that ended before its first step still gets its run
        os.kill(self._process.pid, signal.SIGCONT)  # in case an interrupt came between pause and resume
        if status is not None:
            self._send("finish", status, reason, now_ms())  # the run ends now, not when the writer is done
        else:  # the job goes on later (a requeue): `sync` leaves the run open
            self._record("leave_open", reason or "")
        self._queue.put(_STOP)
        with interrupts_ignored():
            self._process.join(self._close_timeout_s)
            timed_out = self._process.is_alive()
            if timed_out:
                self._process.kill()
                self._process.join()
        # The writer read everything up to the stop marker, or died: either way nothing is left
        # for the queue's feeder thread to deliver, and exit must not wait on it.
        self._queue.cancel_join_thread()
        if self._process.exitcode != 0:
            self.incomplete = f"still writing after {self._close_timeout_s:g} s" if timed_out else "the writer failed"
        if self._journal is not None:
            self._journal.close()


def interrupts_ignored() -> contextlib.AbstractContextManager[None]:
    """The launcher interrupts the ranks of a failed job (SIGINT; torchrun and Slurm: SIGTERM), more
    than once: what is being written then is finished first (the launcher's SIGKILL after a grace
    period bounds the wait)."""
    return signals.ignored(signal.SIGINT, signal.SIGTERM)


def _write_run(
    calls,
    idle,
    cfg: TrackingConfig,
    created: dict,
    claims: dict[str, str],
    run_id_files: tuple[Path, ...],
    parent_pid: int,
) -> None:
    """The writer process's body; `created`: the run to create or resume, as journaled; `claims`:
    its journal's tag (run.claim); `idle`: a shared flag set to 1 once the start-up is over."""
    _die_with_parent(parent_pid)
    # The rank decides when writing ends (close), and the writer dies with it anyway.
    for sig in JOB_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    error, monitor = None, None
    try:
        resume_run_id, run_name, owner = created["resume_run_id"], created["run_name"], created["owner"]
        run = MlflowRun.reopen(cfg.uri, resume_run_id, owner, claims) if resume_run_id else None
        tags = {**created["tags"], owner_tag(owner): "1", **claims}
        run = run or MlflowRun.create(cfg, run_name, tags, created["start_ms"])
    except Exception as err:
        error, run = _said(err), None
    if run is not None:
        for path in run_id_files:
            path.parent.mkdir(parents=True, exist_ok=True)  # a checkpoint folder before its first save
            write_run_id(path, run.run_id, owner)
        print(f"MLflow run {run.run_id} ({run_name}) in {cfg.uri}", flush=True)
        monitor = start_system_metrics(cfg, run.run_id) if cfg.system_metrics else None
    idle.value = 1  # what is left (the queued params and tags) takes a fraction of a second
    for method, args in _batches(calls, training_started=_run_only_on_idle_cores):
        if run is None:
            continue  # drain, so the training loop's queue never fills up
        if method == "finish" and monitor is not None:
            stop_system_metrics(monitor)
            monitor = None
        if method == "finish" and error:
            continue  # a run that lost records stays open: `sync` replays them, then ends it (never an ended run)
        try:
            getattr(run, method)(*args)
        except Exception as err:
            error = error or _said(err)
            if is_store_busy(err):
                run = None  # busy past the retry window: give up rather than wait that long per call
    if monitor is not None:  # the run goes on later (no finish): stop sampling all the same
        stop_system_metrics(monitor)
    gc.freeze()  # the process ends next: MLflow's objects go with it, uncollected (~0.5 s sooner)
    if error:
        print(
            f"titan_exp: tracking failed, the run's MLflow record in {masked(cfg.uri)} is incomplete: {error}",
            flush=True,
        )
        sys.exit(_EXIT_INCOMPLETE)


def _batches(calls, training_started: Callable[[], None]):
    """The queued calls in order until the stop marker; log_metrics calls that arrive within
    _METRICS_FLUSH_SECONDS of each other are merged into one. `training_started()` is called when
    the first metrics arrive (see BackgroundTracker), before their flush window."""
    pending, training = None, False
    while True:
        item, pending = pending or calls.get(), None
        if item == _STOP:
            return
        if item[0] == "log_metrics":
            if not training:
                training = True
                training_started()
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


def _said(err: Exception) -> str:
    """The error in one line: its type and first line (SQLAlchemy's last line is only a link)."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    if is_store_busy(err):
        return f"the store stayed locked by another process past {RETRY_SECONDS:g} s ({lines[0] if lines else err})"
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__

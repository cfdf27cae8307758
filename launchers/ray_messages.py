"""What a Ray job's driver (launchers/ray_driver.py, on the cluster) and the process that submitted
it (launchers/ray.py) say to each other: the payload the job carries there, and the lines the driver
writes on its output, which Ray's job API streams back. A message is one line, MARKER then JSON;
any other line is the driver's own (Ray's notes), kept in the job folder's driver.log."""

import asyncio
import base64
import json
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launchers import signals
from launchers.base import ConfigError, SharedFolder
from launchers.tasks import RankFailure

MARKER = "@titan_exp "
# The payload file in the Ray job's working directory.
PAYLOAD_FILE = "job.pkl"
# Set in each rank: the Ray job it belongs to, and how many times the job started again before.
SUBMISSION_VARIABLE = "TITAN_EXP_RAY_JOB"
ATTEMPT_VARIABLE = "TITAN_EXP_RAY_ATTEMPT"
# Stopping: the ranks get RANK_STOP_GRACE_SECONDS after SIGINT (rank 0 ends its MLflow run) before
# SIGKILL; Ray gives the driver RAY_JOB_STOP_WAIT_TIME_S (set to DRIVER_STOP_WAIT_SECONDS, its
# default 3 s is too short for that) after `ray job stop` before it kills the driver.
RANK_STOP_GRACE_SECONDS = 20.0
DRIVER_STOP_WAIT_SECONDS = int(RANK_STOP_GRACE_SECONDS) + 15
# How long the launching process waits for a job it stopped (Ctrl-C) to end: within the grace a
# sweep gives its points (job/sweep_points.py).
STOP_WAIT_SECONDS = DRIVER_STOP_WAIT_SECONDS + 10.0


@dataclass(frozen=True)
class DriverPayload:
    """Everything the driver needs, pickled into the Ray job's working directory."""

    # cloudpickle of (target, arg), the ranks' callable and argument: unpickled only in the ranks.
    job: bytes
    submission_id: str
    device: str
    nodes: int
    nproc_per_node: int
    threads_per_rank: int
    heartbeat_timeout_s: float
    retries: int
    placement_timeout_s: float
    timeout_s: float
    # The launching process's working directory: the ranks run there where their node has it.
    cwd: str
    # Folders every node must see, each holding a file named visibility_token_name(token).
    shared_folders: tuple[SharedFolder, ...]
    token: str


def visibility_token_name(token: str) -> str:
    return f".titan_exp_visible_{token}"


def say(**message: Any) -> None:
    """From the driver: one message on its output."""
    print(MARKER + json.dumps(message), flush=True)


def encode(data: bytes) -> str:
    return base64.b64encode(data).decode()


class RayJobEnded(RuntimeError):
    """The Ray job ended without a result from its ranks: stopped from outside (`ray job stop`, the
    dashboard), or its driver failed (no room on the cluster, the cluster went away)."""

    def __init__(self, submission_id: str, status: str, why: str, log_path: Path, timed_out: bool = False):
        # KILLED rather than FAILED (tracking/run.py: outcome), as a Slurm job cancelled or timed out.
        self.interrupted = status == "STOPPED" or timed_out
        super().__init__(f"Ray job {submission_id} {status}: {why} (log: {log_path})")


def follow_messages(
    client, submission_id: str, folder: Path, echo: Callable[[str], None], stop: Callable[[], None]
) -> Any:
    """Follow the job's output to its end: each rank's lines into folder/<rank>_log.out (rank 0's
    also to `echo`), the driver's notes echoed; rank 0's result, or raise RankFailure, ConfigError
    (the cluster cannot run the job as configured) or RayJobEnded. A Ctrl-C calls `stop` (the job
    is stopped, its last lines still kept) and raises KeyboardInterrupt once the job ended, or at
    once on a second Ctrl-C."""
    logs = _RankLogs(folder)
    ending: dict[str, Any] = {}
    stream = _Stream(client, submission_id, stop)
    try:
        for line in stream.lines():
            if not line.startswith(MARKER):
                logs.driver(line)
                continue
            message = json.loads(line[len(MARKER) :])
            if "rank" in message and "line" in message:
                logs.rank(message["rank"], message["line"])
                if message["rank"] == 0:
                    echo(message["line"])
            elif "note" in message:
                echo(f"titan_exp: {message['note']}")
                logs.driver(message["note"])
            else:
                ending = message
    finally:
        logs.close()
    if stream.interrupted:
        raise KeyboardInterrupt
    if "result" in ending:
        import cloudpickle

        return cloudpickle.loads(base64.b64decode(ending["result"]))
    if "failure" in ending:
        failure = ending["failure"]
        raise RankFailure(failure["rank"], failure["reason"], folder / f"{failure['rank']}_log.out")
    if "refused" in ending:
        raise ConfigError(**ending["refused"])
    info = client.get_job_info(submission_id)
    status = str(info.status.value if hasattr(info.status, "value") else info.status)
    why = ending.get("ended") or (info.message or "the driver left no word").strip().splitlines()[-1]
    if status == "STOPPED":
        why = "stopped from outside (`ray job stop`, the dashboard, or Ctrl-C here)"
    log = folder / "0_log.out" if (folder / "0_log.out").exists() else folder / "driver.log"
    raise RayJobEnded(submission_id, status, why, log, timed_out=ending.get("timed_out", False))


class _RankLogs:
    """Each rank's log file, opened when its first line comes (a job of thousands of ranks would
    otherwise hold as many files open), and the driver's own."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files: dict[int | str, Any] = {}

    def rank(self, rank: int, line: str) -> None:
        self._write(rank, f"{rank}_log.out", line)

    def driver(self, line: str) -> None:
        self._write("driver", "driver.log", line)

    def _write(self, key: int | str, name: str, line: str) -> None:
        if key not in self.files:
            self.files[key] = (self.folder / name).open("a")
        self.files[key].write(line + "\n")
        self.files[key].flush()

    def close(self) -> None:
        for file in self.files.values():
            file.close()


class _Stream:
    """The job's output, line by line, as Ray's job API streams it, until the job has ended.

    Ray's client is asynchronous: it streams in a thread of its own, so that a Ctrl-C reaches this
    process's main thread. A stream that ends while the job still runs (the head's link to its
    agent dropped; Ray then closes the socket cleanly) is opened again, its text so far skipped (it
    starts from the beginning); once the job ended, what the stream had not given yet is read from
    the job's whole log."""

    def __init__(self, client, submission_id: str, stop: Callable[[], None]):
        self.client, self.submission_id, self.stop = client, submission_id, stop
        self.interrupted = False
        self._stop_deadline: float | None = None

    def lines(self) -> Iterator[str]:
        partial, consumed = "", 0
        while True:
            skip = consumed
            for chunk in self._chunks():
                if skip:
                    chunk, skip = chunk[skip:], max(skip - len(chunk), 0)
                consumed += len(chunk)
                *complete, partial = (partial + chunk).split("\n")
                yield from complete
            if self._ended():
                break
            time.sleep(1.0)
        rest = self.client.get_job_logs(self.submission_id)[consumed:]
        *complete, partial = (partial + rest).split("\n")
        yield from complete
        if partial:
            yield partial

    def _ended(self) -> bool:
        if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
            return True  # stopped, and no longer waited for
        return self.client.get_job_status(self.submission_id).is_terminal()

    def _chunks(self) -> Iterator[str]:
        chunks: queue.Queue = queue.Queue()

        async def tail() -> None:
            try:
                async for chunk in self.client.tail_job_logs(self.submission_id):
                    chunks.put(chunk)
            except Exception:  # a broken stream: lines() opens it again or reads the rest
                pass
            finally:
                chunks.put(None)

        threading.Thread(target=lambda: asyncio.run(tail()), name="ray-job-logs", daemon=True).start()
        while (chunk := self._next(chunks)) is not None:
            yield chunk

    def _next(self, chunks: queue.Queue) -> str | None:
        """The next chunk; short waits, so that a Ctrl-C is taken at once: the first stops the job
        (and the stream goes on to its end, STOP_WAIT_SECONDS at most), a second stops waiting."""
        while True:
            try:
                return chunks.get(timeout=0.5)
            except queue.Empty:
                if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                    return None
            except KeyboardInterrupt:
                if self.interrupted:
                    raise
                self.interrupted = True
                self._stop_deadline = time.monotonic() + STOP_WAIT_SECONDS
                with signals.ignored(signal.SIGINT, signal.SIGTERM):
                    self.stop()

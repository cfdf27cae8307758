"""What a Ray job's driver (launchers/ray_driver.py, on the cluster) and the process that submitted
it (launchers/ray.py) say to each other: the payload the job carries there, and the lines the driver
writes on its output, which Ray's job API streams back. A message is one line, MARKER then JSON;
any other line is the driver's own (Ray's notes), kept in the job folder's driver.log."""

import asyncio
import base64
import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class DriverPayload:
    """Everything the driver needs, pickled into the Ray job's working directory."""

    # cloudpickle of (target, arg), the ranks' callable and argument: unpickled only in the ranks.
    job: bytes
    name: str
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

    def __init__(self, submission_id: str, status: str, why: str, log_path: Path):
        self.interrupted = status == "STOPPED"  # KILLED rather than FAILED (tracking/run.py: outcome)
        super().__init__(f"Ray job {submission_id} {status}: {why} (log: {log_path})")


def follow_messages(client, submission_id: str, folder: Path, ranks: int, echo: Callable[[str], None]) -> Any:
    """Follow the job's output to its end: each rank's lines into folder/<rank>_log.out (rank 0's
    also to `echo`), the driver's notes echoed; rank 0's result, or raise RankFailure, ConfigError
    (the cluster cannot run the job as configured) or RayJobEnded."""
    logs = [(folder / f"{rank}_log.out").open("a") for rank in range(ranks)]
    driver_log = (folder / "driver.log").open("a")
    ending: dict[str, Any] = {}
    try:
        for line in _lines(client, submission_id):
            if not line.startswith(MARKER):
                driver_log.write(line + "\n")
                driver_log.flush()
                continue
            message = json.loads(line[len(MARKER) :])
            if "rank" in message and "line" in message:
                logs[message["rank"]].write(message["line"] + "\n")
                logs[message["rank"]].flush()
                if message["rank"] == 0:
                    echo(message["line"])
            elif "note" in message:
                echo(f"titan_exp: {message['note']}")
                driver_log.write(message["note"] + "\n")
            else:
                ending = message
    finally:
        for log in [*logs, driver_log]:
            log.close()
    log0 = folder / "0_log.out"
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
    raise RayJobEnded(submission_id, status, why, log0 if log0.exists() else folder / "driver.log")


def _lines(client, submission_id: str):
    """The job's output line by line as Ray streams it, until the job ends. Streamed in a thread of
    its own (Ray's client is asynchronous), so that a Ctrl-C reaches this process's main thread;
    where the stream breaks before the end, the rest is read from the job's whole log once it ended."""
    chunks: queue.Queue = queue.Queue()

    async def tail() -> None:
        try:
            async for chunk in client.tail_job_logs(submission_id):
                chunks.put(chunk)
        except Exception as err:
            chunks.put(err)
        finally:
            chunks.put(None)

    threading.Thread(target=lambda: asyncio.run(tail()), name="ray-job-logs", daemon=True).start()
    partial, consumed = "", 0
    while (chunk := _next(chunks)) is not None:
        if isinstance(chunk, Exception):
            while not client.get_job_status(submission_id).is_terminal():
                time.sleep(1.0)
            chunk = client.get_job_logs(submission_id)[consumed:]
        consumed += len(chunk)
        *complete, partial = (partial + chunk).split("\n")
        yield from complete
    if partial:
        yield partial


def _next(chunks: queue.Queue) -> "str | Exception | None":
    """The next chunk; short waits, so that a Ctrl-C is taken at once."""
    while True:
        try:
            return chunks.get(timeout=0.5)
        except queue.Empty:
            continue

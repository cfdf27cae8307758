"""What a Ray job's driver (launchers/ray_driver.py, on the cluster) and the process that submitted
it (launchers/ray.py) say to each other: the payload the job carries there, and the lines the driver
writes on its output, which Ray's job API streams back. A message is one line, MARKER then a JSON
object: its kind and its fields (below); any other line is the driver's own (Ray's notes), kept in
the job folder's driver.log. What comes back is data: each message is checked against its kind's
fields before it is used, rank numbers are integers of the job's world (the only part of a path a
message gives), and nothing in it is unpickled or run."""

import asyncio
import json
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from launchers import signals
from launchers.base import ConfigError, SharedFolder, printable
from launchers.tasks import RankFailure

MARKER = "@titan_exp "
# The longest line taken from the job's output: a longer one is no driver's (a rank's long line
# comes in pieces of RANK_LINE_PIECE_CHARS, at most 6 times as long once JSON escapes them), and it
# is not held in memory to its end.
MAX_LINE_CHARS = 1 << 20
RANK_LINE_PIECE_CHARS = 1 << 16
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
# A log stream silent this long: the job's status is asked (a stream that stays open after the
# job ended, or an address that stopped answering, would otherwise be waited on forever).
SILENT_STREAM_SECONDS = 30.0


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


# The messages, by kind. Text fields are one line each.


@dataclass(frozen=True)
class RankLine:
    """A line of a rank's output (a piece of it, for a long one)."""

    rank: int
    line: str


@dataclass(frozen=True)
class Note:
    """The driver's word for the console: where the ranks went, a job starting again."""

    note: str


@dataclass(frozen=True)
class Result:
    """Every rank returned: rank 0's result as plain JSON data (launchers/ray_rank.py), rebuilt by
    whoever placed the job, which checks it."""

    result: Any


@dataclass(frozen=True)
class Failure:
    """A rank failed: its last line, or how its node was lost."""

    rank: int
    reason: str


@dataclass(frozen=True)
class Refusal:
    """The cluster cannot run the job as configured (nothing ran): a config error."""

    key: str
    value: str
    fix: str


@dataclass(frozen=True)
class Unfinished:
    """The job cannot go on: no room on the cluster, or past its time limit (`timed_out`)."""

    why: str
    timed_out: bool


Message = RankLine | Note | Result | Failure | Refusal | Unfinished
KINDS: dict[str, type] = {
    "line": RankLine,
    "note": Note,
    "result": Result,
    "failure": Failure,
    "refused": Refusal,
    "ended": Unfinished,
}


def say(message: Message) -> None:
    """From the driver: one message on its output."""
    kind = next(kind for kind, cls in KINDS.items() if isinstance(message, cls))
    print(MARKER + json.dumps({"kind": kind, **asdict(message)}), flush=True)


def rank_lines(rank: int, line: str) -> list[RankLine]:
    """A rank's line as messages: in pieces of at most RANK_LINE_PIECE_CHARS."""
    pieces = range(0, len(line), RANK_LINE_PIECE_CHARS)
    return [RankLine(rank, line[i : i + RANK_LINE_PIECE_CHARS]) for i in pieces] or [RankLine(rank, "")]


class Unreadable(ValueError):
    """A line of the job's output that no titan_exp driver writes (why, in a few words)."""


def read_message(text: str) -> Message:
    """The message of a line after its MARKER, each field of its kind's type; raises Unreadable."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as err:  # RecursionError: nested past the parser's depth
        raise Unreadable(f"not JSON ({type(err).__name__})") from None
    kind = data.get("kind") if isinstance(data, dict) else None
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise Unreadable(f"no message kind of {', '.join(KINDS)}")
    wanted = {field.name: field.type for field in fields(cls)}
    given = {name: value for name, value in data.items() if name != "kind"}
    if given.keys() != wanted.keys():
        raise Unreadable(f"a {kind} message has the fields {', '.join(wanted)}, and no other")
    for name, value in given.items():
        # Exactly the type: a JSON true is no rank number.
        if wanted[name] is not Any and type(value) is not wanted[name]:
            raise Unreadable(f"{kind}.{name} is {type(value).__name__}, not {wanted[name].__name__}")
        if isinstance(value, str) and value.splitlines() not in ([], [value]):
            raise Unreadable(f"{kind}.{name} holds a line break")
    # Printed and logged as it comes: no escape sequence from the cluster reaches the terminal.
    return cls(**{name: printable(value) if isinstance(value, str) else value for name, value in given.items()})


class MalformedMessage(RuntimeError):
    """The job's output holds a line that no titan_exp driver writes (a crafted job API, or another
    version of titan_exp on the cluster): the job is stopped, nothing of the line used."""

    def __init__(self, submission_id: str, why: str):
        super().__init__(f"Ray job {submission_id} wrote a line that is no titan_exp message: {why}")


class RayJobEnded(RuntimeError):
    """The Ray job ended without a result from its ranks: stopped from outside (`ray job stop`, the
    dashboard), or its driver failed (no room on the cluster, the cluster went away)."""

    def __init__(self, submission_id: str, status: str, why: str, log_path: Path, timed_out: bool = False):
        # KILLED rather than FAILED (tracking/run.py: outcome), as a Slurm job cancelled or timed out.
        self.interrupted = status == "STOPPED" or timed_out
        super().__init__(f"Ray job {submission_id} {status}: {why} (log: {log_path})")


@dataclass(frozen=True)
class Expected:
    """What the launching process knows of a job's output beforehand: how many ranks it has (the
    ranks it names are integers below), and how rank 0's result is rebuilt from plain data
    (raising TypeError or ValueError where it does not fit)."""

    world_size: int
    rebuild: Callable[[Any], Any]


def follow_messages(
    client, submission_id: str, folder: Path, expected: Expected, echo: Callable[[str], None], stop: Callable[[], None]
) -> Any:
    """Follow the job's output to its end: each rank's lines into folder/<rank>_log.out (rank 0's
    also to `echo`), the driver's notes echoed; rank 0's result, rebuilt, or raise RankFailure,
    ConfigError (the cluster cannot run the job as configured), RayJobEnded or MalformedMessage. A
    Ctrl-C calls `stop` (the job is stopped, its last lines still kept) and raises
    KeyboardInterrupt once the job ended, or at once on a second Ctrl-C."""
    logs = _RankLogs(folder)
    ending: Message | None = None
    stream = _Stream(client, submission_id, stop)
    try:
        for line in stream.lines():
            if not line.startswith(MARKER):
                logs.driver(line)
                continue
            message = read_message(line[len(MARKER) :])
            if isinstance(message, RankLine | Failure) and not 0 <= message.rank < expected.world_size:
                raise Unreadable(f"rank {message.rank} is not one of the job's {expected.world_size}")
            if isinstance(message, RankLine):
                logs.rank(message.rank, message.line)
                if message.rank == 0:
                    echo(message.line)
            elif isinstance(message, Note):
                echo(f"titan_exp: {message.note}")
                logs.driver(message.note)
            else:
                ending = message
    except Unreadable as err:
        raise MalformedMessage(submission_id, str(err)) from None
    finally:
        logs.close()
    if stream.interrupted:
        raise KeyboardInterrupt
    return _ended_as(ending, client, submission_id, folder, expected.rebuild)


def _ended_as(ending: Message | None, client, submission_id: str, folder: Path, rebuild: Callable[[Any], Any]) -> Any:
    """The job's result, or what ended it, from its last message (if any) and its status."""
    if isinstance(ending, Result):
        try:
            return rebuild(ending.result)
        except (TypeError, ValueError) as err:
            raise MalformedMessage(submission_id, f"rank 0's result: {err}") from None
    if isinstance(ending, Failure):
        raise RankFailure(ending.rank, ending.reason, folder / f"{ending.rank}_log.out")
    if isinstance(ending, Refusal):
        raise ConfigError(ending.key, ending.value, ending.fix)
    info = client.get_job_info(submission_id)
    status = str(info.status.value if hasattr(info.status, "value") else info.status)
    if isinstance(ending, Unfinished):
        why = ending.why
    else:
        why = (info.message or "the driver left no word").strip().splitlines()[-1]
    if status == "STOPPED":
        why = "stopped from outside (`ray job stop`, the dashboard, or Ctrl-C here)"
    log = folder / "0_log.out" if (folder / "0_log.out").exists() else folder / "driver.log"
    timed_out = isinstance(ending, Unfinished) and ending.timed_out
    raise RayJobEnded(submission_id, status, why, log, timed_out=timed_out)


class _RankLogs:
    """Each rank's log file, opened when its first line comes (a job of thousands of ranks would
    otherwise hold as many files open), and the driver's own."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files: dict[int | str, Any] = {}  # by rank (checked), and "driver"

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
                *complete, partial = _split(partial + chunk)
                yield from complete
            if self._ended():
                break
            time.sleep(1.0)
        rest = self.client.get_job_logs(self.submission_id)[consumed:]
        *complete, partial = _split(partial + rest)
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
        """The next chunk (None: the stream ended, or went silent after the job's end); short waits,
        so that a Ctrl-C is taken at once: the first stops the job (and the stream goes on to its
        end, STOP_WAIT_SECONDS at most), a second stops waiting."""
        silent_since = time.monotonic()
        while True:
            try:
                return chunks.get(timeout=0.5)
            except queue.Empty:
                if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                    return None
                if time.monotonic() - silent_since > SILENT_STREAM_SECONDS:
                    if self._ended():  # lines() reads what the stream did not give
                        return None
                    silent_since = time.monotonic()
            except KeyboardInterrupt:
                if self.interrupted:
                    raise
                self.interrupted = True
                self._stop_deadline = time.monotonic() + STOP_WAIT_SECONDS
                with signals.ignored(signal.SIGINT, signal.SIGTERM):
                    self.stop()


def _split(text: str) -> list[str]:
    """The complete lines of `text`, then what follows the last line break; raises Unreadable for a
    line longer than MAX_LINE_CHARS (the part that follows included: it is held until its end)."""
    parts = text.split("\n")
    if any(len(part) > MAX_LINE_CHARS for part in parts):
        raise Unreadable(f"a line longer than {MAX_LINE_CHARS} characters")
    return parts

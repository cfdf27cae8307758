"""What the launchers read back from the rank tasks that submitit ran, locally or on Slurm: their
outcome (the result pickle each task leaves) and their console output (rank 0's, streamed)."""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from submitit.core.utils import pickle_load

# submitit's own log lines in each task's output; not worth echoing.
_SUBMITIT_PREFIX = "submitit "


class RankFailure(RuntimeError):
    """A rank ended without its result: it raised (the exception's last line) or it was killed."""

    def __init__(self, rank: int, reason: str, log_path: Path):
        self.rank, self.reason, self.log_path = rank, reason, log_path
        super().__init__(f"rank {rank} failed: {reason} (log: {log_path})")


class RankRaised(RuntimeError):
    """What a rank raised that is not an Exception (torch's CheckpointException is a BaseException),
    as an Exception that submitit records in the rank's result."""


def run_recording_failures(fn: Callable[[Any], Any], arg: Any) -> Any:
    """fn(arg), any failure of it recorded by submitit: it records Exceptions only, and a rank that
    raised anything else would look killed. Interrupts and exits pass through as they are."""
    try:
        return fn(arg)
    except (Exception, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as err:
        raise RankRaised(f"{type(err).__name__}: {err}") from err


def read_result(rank: int, result_pickle: Path, log_path: Path) -> tuple[bool, object]:
    """(True, rank's return value), or (False, None) if it left no result yet; raises RankFailure
    when it raised."""
    if not result_pickle.exists():
        return False, None
    outcome, payload = pickle_load(result_pickle)
    if outcome == "error":
        raise RankFailure(rank, last_line(str(payload)), log_path)
    return True, payload


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "unknown error"


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed on this machine since boot (None
    where /proc/vmstat does not say)."""
    try:
        found = re.search(r"^oom_kill (\d+)$", Path("/proc/vmstat").read_text(), re.M)
    except OSError:
        return None
    return int(found.group(1)) if found else None


def why_gone(log_path: Path, oom_kills_before: int | None) -> str:
    """Why a rank exited without a result, as far as this machine tells: a crash its log names
    (faulthandler's "Fatal Python error: Segmentation fault"), the OOM killer (its count rose while
    the job ran), else SIGKILL, the one signal that leaves no word (kill -9, a time limit)."""
    tail = log_path.read_text(errors="replace")[-65536:] if log_path.exists() else ""  # a traceback follows
    if crash := re.search(r"Fatal Python error: (.+)", tail):
        return f"crashed: {crash.group(1).strip()}"
    now = oom_kills()
    if oom_kills_before is not None and now is not None and now > oom_kills_before:
        rose = now - oom_kills_before
        return f"killed by the kernel's OOM killer (out of memory: /proc/vmstat oom_kill rose by {rose})"
    return f"killed by SIGKILL (kill -9 or a time limit; it left no word); its log ends: {log_tail(log_path)}"


def log_tail(path: Path) -> str:
    """The last line of a task's log, for a failure message."""
    if not path.exists():
        return "no log"
    return last_line(path.read_text(errors="replace")[-4000:])


class LogFollower:
    """Hands on the complete lines a growing log file gains (submitit's own lines left out)."""

    def __init__(self, path: Path, echo: Callable[[str], None]):
        self.path, self.echo = path, echo
        self._offset = 0
        self._partial = ""

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("r", errors="replace") as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if not line.startswith(_SUBMITIT_PREFIX):
                self.echo(line)

"""Heartbeats between the ranks and the launching process: each rank touches a file of its own
every few seconds from a thread of its own, and the launching process names a rank whose file
stopped changing. A rank stopped (SIGSTOP, a debugger) or hung where Python's threads cannot run
stops beating; a rank merely waiting in a collective for a peer keeps beating (its collective
releases the GIL), so the silent rank is the one named, not the healthy ones waiting for it."""

import os
import socket
import threading
import time
from pathlib import Path

# How often a rank beats. The launching process's limit (launcher.heartbeat_timeout_s) should be
# many beats long: a loaded machine delays a beat by seconds.
BEAT_SECONDS = 2.0


def heartbeat_file(folder: Path, job_id: str, rank: int) -> Path:
    # Named after the job like submitit's own files, so a reused folder holds no stale beats.
    return folder / f"{job_id}_{rank}.heartbeat"


def start_beating(path: Path) -> None:
    """Touch `path` now and every BEAT_SECONDS from a daemon thread, for the life of this process.
    The file names this host, for the launching process to say where a silent rank ran."""
    path.write_text(socket.gethostname())

    def beat() -> None:
        while True:
            time.sleep(BEAT_SECONDS)
            try:
                os.utime(path)
            except OSError:  # the folder went away: the launching process cleaned up
                return

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def silence(silent_s: float, limit_s: float, then: str, host: str | None = None) -> str:
    """A silent rank's failure reason; `then`: what was done about it; `host`: where it ran, when
    that is not this machine (its node may be what went down)."""
    where, why = (f" from {host}", "or its node went down") if host else ("", "or hung where no Python thread runs")
    return (
        f"stopped answering: no heartbeat for {silent_s:.0f} s{where} (stopped, {why}; "
        f"launcher.heartbeat_timeout_s={limit_s:g}); {then}"
    )


def beating_host(path: Path) -> str | None:
    """The host of the rank behind `path`, as its first beat named it (None before that)."""
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def silent_for(path: Path, now: float | None = None) -> float | None:
    """Seconds since the rank behind `path` last beat; None before its first beat (still starting)."""
    try:
        return (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return None

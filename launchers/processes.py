"""The processes of a job as /proc shows them (no psutil needed), and the launching process a rank
watches: a rank whose launching process dies stops rather than train on for nobody."""

import _thread
import signal
import sys
import threading
import time
from pathlib import Path

from launchers import signals

# How often each rank checks that the launching process is still there.
LAUNCHER_WATCH_SECONDS = 1.0


# The launching process a rank of ours watches (set in the rank).
_watched: list[int] = []


def launcher_gone() -> signals.LauncherDied | None:
    """LauncherDied if this process is a rank of ours whose launching process is gone. Its peers
    may stop first, so a rank can fail in a collective before its own interrupt arrives: this says
    what that failure really was."""
    if _watched and not process_alive(_watched[0]):
        return signals.LauncherDied(_watched[0])
    return None


def stop_if_launcher_gone() -> None:
    """Raise LauncherDied if this rank's launching process is gone. The training loop asks between
    steps because the watcher's one interrupt can be lost: a handler run inside a `__del__` (or any
    callback whose errors Python only prints) raises into nothing, and one that finds an exception
    being handled does not raise (stop_when_gone)."""
    if gone := launcher_gone():
        raise gone


def stop_when_gone(launcher_pid: int) -> None:
    """Interrupt this rank (LauncherDied in its main thread) if the launching process dies: killed
    outright, it cannot stop the ranks itself, and submitit's controller would let them train on."""
    _watched[:] = [launcher_pid]

    def interrupt(signum: int, frame: object) -> None:
        if process_alive(launcher_pid):
            raise KeyboardInterrupt()
        # A rank already ending with an exception in hand (stop_if_launcher_gone, a peer's failure in a
        # collective) is left to end: raised inside its handler, this one would cut short what the
        # handler records (a CI run's rank 0 ended FINISHED that way).
        if sys.exc_info()[1] is None:
            raise signals.LauncherDied(launcher_pid)

    def watch() -> None:
        while process_alive(launcher_pid):
            time.sleep(LAUNCHER_WATCH_SECONDS)
        _thread.interrupt_main(signal.SIGINT)

    signal.signal(signal.SIGINT, interrupt)
    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def children(parent: int) -> set[int]:
    """The live and zombie processes whose parent is `parent`."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            found.add(int(stat.parent.name))
    return found


def process_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (/proc; no psutil needed)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # gone, or going while being read
        return False
    return state not in ("Z", "X")

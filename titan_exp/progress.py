"""Progress of long work (a plan grid, a sweep's points, the loss-parity layouts): k of n, the time
since it began and an estimate of the time left at this pace; redrawn in place on a terminal, one
plain line per step elsewhere (a log keeps every line). A run's logged steps carry the time left on
their own lines (train/leader.py)."""

import time
from typing import TextIO


def duration(seconds: float) -> str:
    """Seconds as a person reads them: 42 s, 3 min 05 s, 1 h 12 min."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def time_left(done: int, total: int, elapsed: float) -> str:
    """`~3 min 20 s left`: the rest at the pace so far, so none before the first item is done, nor
    after the last ("")."""
    return f"~{duration(elapsed / done * (total - done))} left" if 0 < done < total else ""


def progress_line(what: str, done: int, total: int, elapsed: float) -> str:
    """`what k of n (elapsed, ~left)`."""
    left = time_left(done, total, elapsed)
    return f"{what} {done} of {total} ({duration(elapsed)}{f', {left}' if left else ''})"


class Progress:
    """k of `total` items of work done, timed from this object's creation."""

    def __init__(self, what: str, total: int, stream: TextIO):
        self.what, self.total, self.stream = what, total, stream
        self.live = stream.isatty()
        self.start = time.monotonic()

    def line(self, done: int) -> str:
        return progress_line(self.what, done, self.total, time.monotonic() - self.start)

    def show(self, done: int) -> None:
        """On a terminal the line is redrawn where it stands, ended by a newline once all is done."""
        if self.live:
            self.stream.write(f"\r\x1b[2K{self.line(done)}" + ("\n" if done >= self.total else ""))
        else:
            self.stream.write(self.line(done) + "\n")
        self.stream.flush()

"""titan_exp/progress.py: k of n, elapsed and the time left at this pace, redrawn in place on a
terminal and one plain line per step in a log."""

import io

from titan_exp.progress import Progress, duration, progress_line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_durations_read_as_a_person_reads_them():
    assert [duration(s) for s in (0.4, 42, 185, 4320)] == ["0 s", "42 s", "3 min 05 s", "1 h 12 min"]


def test_time_left_is_the_pace_so_far_times_what_remains():
    assert progress_line("planned", 3, 13, elapsed=60) == "planned 3 of 13 (1 min 00 s, ~3 min 20 s left)"
    # No pace before the first item, nothing left after the last.
    assert progress_line("planned", 0, 13, elapsed=5) == "planned 0 of 13 (5 s)"
    assert progress_line("planned", 13, 13, elapsed=600) == "planned 13 of 13 (10 min 00 s)"


def test_a_log_gets_a_line_per_step_and_a_terminal_one_line_redrawn():
    log, screen = io.StringIO(), Terminal()
    for stream in (log, screen):
        progress = Progress("planned", 2, stream)
        progress.show(1)
        progress.show(2)
    assert [line.split(" (")[0] for line in log.getvalue().splitlines()] == ["planned 1 of 2", "planned 2 of 2"]
    drawn = screen.getvalue()
    assert drawn.count("\r\x1b[2K") == 2 and drawn.count("\n") == 1 and drawn.endswith("\n")
    assert drawn.split("\r\x1b[2K")[1].startswith("planned 1 of 2 (") and " left)" in drawn

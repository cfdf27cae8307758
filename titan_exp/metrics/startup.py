"""Where a job's start-up goes, from the command's start to the end of its first step: wall-clock
marks taken in the launching process (carried to the ranks in RunContext) and in rank 0, which
prints the breakdown after its first step and logs it as `startup/*` metrics. Torch-free.

Each mark names the phase that ends there; the first mark is the origin: when the launching
process's program started (program_start: the interpreter's own start and imports count), or the
rank's where nothing of ours launched it (srun), or torchrun's agent's creation (the command's start)."""

import os
import time
from pathlib import Path

import titan_exp

Marks = tuple[tuple[str, float], ...]
ORIGIN = "origin"

# This process's marks, in order: (phase that ended, time.time()).
_marks: list[tuple[str, float]] = []


def process_start_time(pid: int | str = "self") -> float:
    """When a process was created, on time.time()'s scale: its start in clock ticks since boot
    (/proc/PID/stat) against the uptime, to 0.01 s. Now, where /proc cannot tell."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of proc(5), counted from field 3
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))


def program_start() -> float:
    """When this process's program (the interpreter) started, on time.time()'s scale: the later of
    its creation and titan_exp's first line less the CPU time used by then. An exec keeps the
    creation, so for a shell's last command (`bash -c 'setup.sh && titan_exp'`: bash execs it) that
    is the shell's; the CPU time carries over too, but a shell that waited on its commands used next
    to none, while the interpreter's start-up is CPU work (what it waits on the disk for is left out)."""
    reached, cpu_seconds = titan_exp.REACHED
    return max(process_start_time(), reached - cpu_seconds)


def mark(phase: str, at: float | None = None) -> None:
    """`phase` ended now (or `at`). The first mark of a process is its program's start, or torchrun's
    creation (its agent, this process's parent, is where the command started)."""
    if not _marks:
        torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        _marks.append((ORIGIN, process_start_time(os.getppid()) if torchrun else program_start()))
    _marks.append((phase, time.time() if at is None else at))


def restart() -> None:
    """Another job of this process (a parity run's next layout): its clock starts now."""
    _marks[:] = [(ORIGIN, time.time())]


def carried() -> Marks:
    """This process's marks so far, to hand on to the ranks."""
    return tuple(_marks)


def adopt(marks: Marks) -> None:
    """Continue from the launching process's marks (in the rank it launched); the gap up to the
    rank process's creation is the launcher's spawning."""
    if marks:
        _marks[:] = list(marks)
        mark("spawn", at=process_start_time())


def phases() -> dict[str, float]:
    """Seconds per phase in order, and `total` from the origin to the last mark."""
    durations = {name: end - start for (_, start), (name, end) in zip(_marks, _marks[1:])}
    if len(_marks) > 1:
        durations["total"] = _marks[-1][1] - _marks[0][1]
    return durations


def summary_line() -> str:
    """e.g. `start-up: 5.21 s to the end of the first step = python_imports 0.35 + compose 0.12 + ...`"""
    durations = phases()
    total = durations.pop("total", 0.0)
    parts = " + ".join(f"{name} {seconds:.2f}" for name, seconds in durations.items())
    return f"start-up: {total:.2f} s to the end of the first step = {parts}"


def as_metrics() -> dict[str, float]:
    """`startup/<phase>_s` and `startup/total_s`: metrics rather than params, logged at the first
    step of each start, so that a requeued job that resumes its run keeps every start's figures."""
    return {f"startup/{name}_s": round(seconds, 3) for name, seconds in phases().items()}

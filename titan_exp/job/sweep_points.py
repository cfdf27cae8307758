"""The points of a sweep run side by side, each a job of its own: its resolved job, as the sweep
resolved and checked it, run by a process of its own (job/point.py; its console in <point
dir>/console.log), started as soon as the machine has room for it, in order.

Room: on this machine, GPUs (a point takes one per rank, as CUDA_VISIBLE_DEVICES) or CPU cores (a
point takes an equal share of them, by affinity: as many points at a time as leave each rank a core,
or launcher.max_parallel if fewer, or more when every point has launcher.oversubscribe=true). A point
whose engine places its ranks elsewhere (a Slurm job) needs no room here: as many of them are in
flight as its engine allows (Launcher.points_in_flight). The console shows one line per point
(queued, running at step N, done, failed and why), redrawn in place on a terminal and printed as
it changes elsewhere; a point's state comes from the events its processes write (job/events.py).
"""

import contextlib
import ctypes
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from launchers.devices import visible_gpu_ids
from titan_exp.checkpoint.config import OWN_FOLDER, own_folder
from titan_exp.config.job import ResolvedJob
from titan_exp.config.schema import JobConfig
from titan_exp.job import events
from titan_exp.job.preflight import preflight
from titan_exp.job.resume import resolve_to_run
from titan_exp.progress import Progress
from titan_exp.rules import ConfigError

# In a point's folder: its resolved job, as the sweep hands it to the point's process (job/point.py).
JOB_FILE = "job.pkl"
POLL_SECONDS = 0.5
# After a Ctrl-C, how long running points get to stop their own ranks (or cancel their engines' jobs).
STOP_GRACE_SECONDS = 60.0


@dataclass
class SweepPoint:
    number: int
    overrides: list[str]
    job_dir: Path
    # The point's resolved job, or why it was refused (then the sweep is: check_every_point).
    job: ResolvedJob | None = None
    refused: ConfigError | None = None
    state: str = "queued"  # queued | running | done | failed | pruned (plan.prune: predicted not to fit)
    detail: str = ""
    process: subprocess.Popen | None = None
    cores: tuple[int, ...] = ()
    gpus: tuple[str, ...] = ()
    # What sets the point apart from the others (see label_points).
    label: str = ""
    # Its CPU ranks' threads are the cores it is given, shared out (launcher.cpu_threads_per_rank=-1).
    threads_follow_cores: bool = False
    # What it has reported so far (job/events.py): where it was placed, its last logged step, why it failed.
    where: str = ""
    progress: str = "starting"
    failure: str = ""

    @property
    def console(self) -> Path:
        return self.job_dir / "console.log"

    @property
    def placed_here(self) -> bool:
        """Its ranks run on this machine (its engine's), taking room here."""
        return self.job is not None and self.job.launcher.on_this_machine

    @property
    def ranks_here(self) -> int:
        return self.job.placement.nproc_per_node if self.placed_here else 0


def prepare_point(number: int, overrides: list[str], job_dir: Path, cfg: JobConfig) -> SweepPoint:
    """A point, its job resolved and checked here, before any point starts, to know what room it needs."""
    point = SweepPoint(number, list(overrides), job_dir, threads_follow_cores=cfg.launcher.cpu_threads_per_rank == -1)
    try:
        point.job = resolve_to_run(cfg, job_dir)
        preflight(point.job)
    except ConfigError as err:
        point.refused = err
    return point


def check_every_point(points: list[SweepPoint]) -> None:
    """Raise the first point's config error, naming the point: a sweep with a bad point is refused
    before any point starts."""
    label_points(points)
    for point in points:
        if point.refused is not None:
            err = point.refused
            raise ConfigError(err.key, err.value, f"{err.fix} (sweep point [{point.number}]: {point.label})")
    seen: dict[str, SweepPoint] = {}  # by the resolved config's text: its sections are not hashable
    for point in points:
        if point.job is None:  # pruned before it was resolved
            continue
        if (first := seen.setdefault(repr(_as_any_point(point)), point)) is not point:
            raise ConfigError(
                "sweep",
                f"[{first.number}] {' '.join(first.overrides)}, [{point.number}] {' '.join(point.overrides)}",
                "these points are the same job; drop one of them",
            )
    _own_checkpoint_folders(points)


def _own_checkpoint_folders(points: list[SweepPoint]) -> None:
    """Points that checkpoint each write into a folder of their own: two in one folder would
    overwrite each other's steps, and resume from them."""
    writers: dict[Path, SweepPoint] = {}
    for point in points:
        if point.job is None or not point.job.config.checkpoint.enable:
            continue
        folder = Path(point.job.config.checkpoint.folder).absolute()
        if (first := writers.setdefault(folder, point)) is not point:
            raise ConfigError(
                "checkpoint.folder",
                point.job.config.checkpoint.folder,
                f"sweep points [{first.number}] and [{point.number}] would save and resume each other's steps "
                "there; leave it unset (each point checkpoints in its own job folder) or sweep it too",
            )


def _as_any_point(point: SweepPoint) -> JobConfig:
    """The point's config, what is its own for being this point left out: its checkpoint folder
    under its job folder (the default)."""
    if point.job.config.checkpoint.folder != own_folder(point.job_dir):
        return point.job.config
    return point.job.replaced(checkpoint={"folder": OWN_FOLDER}).config


def label_points(points: list[SweepPoint]) -> None:
    """Name each point by the overrides that vary across the sweep (all of them for a lone point)."""
    for point, label in zip(points, labels([p.overrides for p in points])):
        point.label = label


def labels(points: list[list[str]]) -> list[str]:
    """Each point's name: its overrides that vary across the points, or "(defaults)"."""
    return [" ".join(mine) or "(defaults)" for mine in varying(points)]


def varying(points: list[list[str]]) -> list[list[str]]:
    """Each point's overrides that vary across the points (all of them for a lone point)."""
    shared = set.intersection(*map(set, points)) if len(points) > 1 else set()
    return [[o for o in point if o not in shared] for point in points]


@dataclass
class _Room:
    """Free GPUs and cores of this machine, and how many points may run at once."""

    gpus: list[str]
    cores: list[int]
    cores_per_point: int
    max_parallel: int
    running: list[SweepPoint] = field(default_factory=list)

    @classmethod
    def of_this_machine(cls, points: list[SweepPoint], max_parallel: int) -> "_Room":
        cores = sorted(os.sched_getaffinity(0))
        on_cpu = [p for p in points if p.placed_here and p.job.placement.device == "cpu"]
        fit = max(1, len(cores) // max((p.ranks_here for p in on_cpu), default=1))  # a core per rank
        # max_parallel caps the points side by side; beyond what fits only if every point oversubscribes.
        oversubscribing = bool(on_cpu) and all(p.job.config.launcher.oversubscribe for p in on_cpu)
        side_by_side = fit if max_parallel <= 0 else max_parallel if oversubscribing else min(max_parallel, fit)
        return cls(visible_gpu_ids(), cores, max(1, len(cores) // side_by_side), max_parallel)

    def take(self, point: SweepPoint) -> bool:
        """Give `point` what it needs if it is free now."""
        if point.placed_here:
            if self.max_parallel > 0 and sum(p.placed_here for p in self.running) >= self.max_parallel:
                return False
            if not self._allocate(point):
                return False
        else:
            engine = point.job.launcher
            alike = sum(p.job.config.launcher.name == engine.name for p in self.running)
            if alike >= engine.points_in_flight():
                return False
        self.running.append(point)
        return True

    def _allocate(self, point: SweepPoint) -> bool:
        """A GPU per rank for a CUDA point, a share of the cores for a CPU one."""
        if point.job.placement.device == "cuda":
            if len(self.gpus) < point.ranks_here:
                return False
            point.gpus, self.gpus = tuple(self.gpus[: point.ranks_here]), self.gpus[point.ranks_here :]
            return True
        if len(self.cores) < self.cores_per_point:
            return False
        point.cores, self.cores = tuple(self.cores[: self.cores_per_point]), self.cores[self.cores_per_point :]
        return True

    def give_back(self, point: SweepPoint) -> None:
        self.running.remove(point)
        self.gpus += point.gpus
        self.cores = sorted(self.cores + list(point.cores))


def run_points(points: list[SweepPoint], parent_run_id: str | None, max_parallel: int) -> None:
    """Run every point to its end (state done or failed), its MLflow run a child of `parent_run_id`.
    Ctrl-C (or SIGTERM) stops the running points (each stops its own ranks or cancels its engine's
    job) and raises."""
    label_points(points)
    room = _Room.of_this_machine(points, max_parallel)
    waiting = deque(points)
    board = StatusBoard(sys.stdout, len(points))
    readers: dict[int, events.EventReader] = {}
    try:
        while waiting or room.running:
            while waiting and room.take(waiting[0]):
                point = waiting.popleft()
                _start(point, parent_run_id)
                readers[point.number] = events.EventReader(point.job_dir)
            for point in list(room.running):
                if _poll(point, readers[point.number]):
                    room.give_back(point)
            board.show(points)
            time.sleep(POLL_SECONDS)
        board.show(points)
    except KeyboardInterrupt as err:
        _stop(room.running, signal.Signals(getattr(err, "signum", signal.SIGINT)))
        for point in waiting:
            point.state, point.detail = "failed", "not started: the sweep was interrupted"
        board.show(points)
        raise


def _start(point: SweepPoint, parent_run_id: str | None) -> None:
    """The point's process, handed its job (with the room it was given) in its folder."""
    job = point.job.with_parent_run(parent_run_id) if parent_run_id else point.job
    if point.cores and point.threads_follow_cores:
        job = job.on_cores(len(point.cores))
    point.job_dir.mkdir(parents=True, exist_ok=True)
    with open(point.job_dir / JOB_FILE, "wb") as f:
        pickle.dump(job, f)
    command = [sys.executable, "-m", "titan_exp.job.point", str(point.job_dir)]
    env = dict(os.environ)
    if point.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(point.gpus)
    with open(point.console, "w") as console:
        point.process = subprocess.Popen(
            command, env=env, stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=lambda: _confine(point.cores),
        )  # fmt: skip
    point.state = "running"


def _confine(cores: tuple[int, ...]) -> None:
    """In the point's process, before exec: its cores, and SIGTERM when the sweep's process dies."""
    if cores:
        os.sched_setaffinity(0, cores)
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _poll(point: SweepPoint, reader: events.EventReader) -> bool:
    """Update the point from its events; True once its process has ended (asked first, so that
    every event it wrote is read below)."""
    code = point.process.poll()
    for event in reader.new():
        if event["event"] == events.PLACED:
            point.where = f"{event['where']}, "
        elif event["event"] == events.STEP:
            point.progress = f"step {event['step']}, loss {event['loss']:.4f}"
        elif event["event"] == events.END and not event["ok"]:
            point.failure = event["reason"]
    if code is None:
        point.detail = f"{point.where}{point.progress}"
        return False
    if code == 0:
        point.state, point.detail = "done", f"{point.where}{point.progress}"
    else:
        reason = point.failure or f"its process exited with {code} without saying why"
        point.state, point.detail = "failed", f"{reason} (log: {point.console})"
    return True


def _stop(running: list[SweepPoint], sig: signal.Signals) -> None:
    """`sig`, the signal that stopped the sweep, to every running point (a terminal's Ctrl-C reaches
    them too), so that each records what stopped it; then SIGKILL for any still there after
    STOP_GRACE_SECONDS."""
    for point in running:
        with contextlib.suppress(ProcessLookupError):
            point.process.send_signal(sig)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for point in running:
        try:
            point.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            point.process.kill()
            point.process.wait()
        point.state, point.detail = "failed", f"stopped by {sig.name}"


class StatusBoard:
    """One line per point and how many have ended (k of n, elapsed, time left): redrawn in place on
    a terminal, printed when it changes elsewhere."""

    def __init__(self, stream: TextIO, total: int):
        self.stream = stream
        self.live = stream.isatty()
        self.drawn = 0
        self.printed: dict[int, str] = {}
        self.progress = Progress("points ended:", total, stream)
        self.ended = 0

    def show(self, points: list[SweepPoint]) -> None:
        lines = [f"[{p.number}] {p.label}: {p.state}" + (f" ({p.detail})" if p.detail else "") for p in points]
        ended = sum(p.state in ("done", "failed") for p in points)
        if self.live:
            lines.append(self.progress.line(ended))
            self.stream.write(f"\x1b[{self.drawn}F" if self.drawn else "")
            self.stream.write("".join(f"\x1b[2K{line}\n" for line in lines))
            self.drawn = len(lines)
        else:
            for point, line in zip(points, lines):
                # Plain output (a log file) gets a line when a point changes state, not every step.
                if self.printed.get(point.number) != point.state:
                    self.printed[point.number] = point.state
                    self.stream.write(line + "\n")
            if ended != self.ended:
                self.stream.write(self.progress.line(ended) + "\n")
        self.ended = ended
        self.stream.flush()

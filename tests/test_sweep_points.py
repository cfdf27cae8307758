"""Sweep points side by side (titan_exp/job/sweep_points.py): the room each point gets on this
machine, the console's line per point, and a real local sweep stopped by Ctrl-C (one whose points
overlap in time, each on a core of its own: test_tracking's local sweep)."""

import io
import os
import signal
import subprocess
import sys
import time

import pytest

from launchers.base import Placement
from titan_exp.config.job import ResolvedJob
from titan_exp.config.schema import JobConfig
from titan_exp.config.sections import LAUNCHER_SECTIONS
from titan_exp.job.sweep_points import StatusBoard, SweepPoint, _Room, _stop, label_points
from titan_exp.parallel.dims import ParallelDims
from titan_exp.tracking.store import with_retries

from conftest import REPO, SMALL_MODEL, mlflow_runs, run_cli, start_as_in_a_terminal, stopped_for_good


def point(
    number: int, overrides: list[str], nproc: int = 1, launcher: str = "local", device: str = "cpu", **options
) -> SweepPoint:
    cfg = JobConfig(launcher=LAUNCHER_SECTIONS[launcher](nproc_per_node=nproc, device=device, **options))
    job = ResolvedJob(cfg, ParallelDims(1, 1, nproc, 1, 1), Placement(launcher, device, nproc, 1, 1))
    return SweepPoint(number, overrides, job_dir=None, job=job)


def test_points_are_named_by_what_varies():
    points = [point(0, ["model=llama3_8b", "debug.seed=0"]), point(1, ["model=llama3_8b", "debug.seed=1"])]
    label_points(points)
    assert [p.label for p in points] == ["debug.seed=0", "debug.seed=1"]


def test_cores_are_shared_out_disjointly_and_slurm_points_need_none():
    room = _Room(gpus=["0", "1", "2", "3"], cores=[0, 1, 2, 3], cores_per_point=2, max_parallel=-1)
    cpu_a, cpu_b, cpu_c = point(0, [], 2), point(1, [], 2), point(2, [], 2)
    assert room.take(cpu_a) and room.take(cpu_b) and not room.take(cpu_c)
    assert set(cpu_a.cores).isdisjoint(cpu_b.cores) and len(cpu_a.cores) == 2
    gpu = point(3, [], 3, device="cuda")
    assert room.take(gpu) and gpu.gpus == ("0", "1", "2") and not room.take(point(4, [], 2, device="cuda"))
    on_slurm = [point(5, [], 8, launcher="slurm", array_parallelism=1) for _ in range(2)]
    assert room.take(on_slurm[0]) and not room.take(on_slurm[1])  # its engine's limit on points in flight
    room.give_back(cpu_a)
    assert room.take(cpu_c) and cpu_c.cores == cpu_a.cores


def test_max_parallel_caps_points_running_here():
    room = _Room(gpus=[], cores=[0, 1, 2, 3], cores_per_point=1, max_parallel=2)
    assert room.take(point(0, [])) and room.take(point(1, [])) and not room.take(point(2, []))


def test_console_lines_update_in_place_on_a_terminal_and_print_changes_elsewhere():
    points = [point(0, ["a=1"]), point(1, ["a=2"])]
    label_points(points)
    log = io.StringIO()
    board = StatusBoard(log, len(points))
    board.show(points)
    points[0].state, points[0].detail = "running", "step 3, loss 7.1"
    board.show(points)
    points[0].detail = "step 4, loss 7.0"
    board.show(points)  # a new step only: nothing new in a log
    assert log.getvalue().splitlines() == ["[0] a=1: queued", "[1] a=2: queued", "[0] a=1: running (step 3, loss 7.1)"]
    points[0].state = "done"
    board.show(points)  # an ended point: how many have, and the time left at this pace
    point_line, progress_line = log.getvalue().splitlines()[-2:]
    assert point_line == "[0] a=1: done (step 4, loss 7.0)" and progress_line.startswith("points ended: 1 of 2 (")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    board = StatusBoard(screen, len(points))
    board.show(points)
    board.show(points)  # two points' lines and the progress line, drawn over
    assert screen.getvalue().count("\x1b[3F") == 1 and screen.getvalue().count("\x1b[2K") == 6
    assert screen.getvalue().rsplit("\x1b[2K", 1)[1].startswith("points ended: 1 of 2 (")


def test_ctrl_c_stops_every_point_and_ends_the_sweep_killed(tmp_path, store):
    uri, db = store
    command = [
        sys.executable, "-m", "titan_exp", "-m", f"hydra.sweep.dir={tmp_path}/multirun", "experiment=smoke",
        *SMALL_MODEL, "tracking=mlflow", uri, "launcher.device=cpu", "parallelism=single", "training.steps=5000",
        "debug.seed=0,1",
    ]  # fmt: skip
    proc = start_as_in_a_terminal(command, stdout=subprocess.DEVNULL)
    with stopped_for_good(proc, lambda proc: os.killpg(proc.pid, signal.SIGINT)):
        deadline = time.monotonic() + 120
        while len(_runs_so_far(db)) < 2:  # both points are training
            assert time.monotonic() < deadline and proc.poll() is None, "the points never started"
            time.sleep(0.5)
    assert proc.returncode != 0
    assert {run.info.status for run in mlflow_runs(db)} == {"KILLED"}
    [parent] = mlflow_runs(db, sweeps=True)
    assert parent.info.status == "KILLED"


def _runs_so_far(db) -> list:
    """The training runs so far, read through the project's client (tracking/store.py's client: it
    would create a missing store whole, never racing the sweep), retried while the sweep writes."""
    return with_retries(lambda: mlflow_runs(db))


def test_a_stopped_sweep_passes_its_signal_on_to_its_points():
    """Issue 68, faults: a sweep stopped with SIGTERM recorded its points as stopped by
    KeyboardInterrupt (it sent them SIGINT); each point now gets the signal that stopped the sweep,
    and so records it (job/point.py: "stopped by SIGTERM")."""
    got = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda s, f: sys.exit(s)); time.sleep(60)"
    stopped = point(0, [])
    stopped.process = subprocess.Popen([sys.executable, "-c", got])
    time.sleep(1.0)  # its handler is in place
    _stop([stopped], signal.SIGTERM)
    assert stopped.process.returncode == signal.SIGTERM and stopped.detail == "stopped by SIGTERM"


def test_a_sweep_over_the_store_is_refused_before_anything_starts(tmp_path, new_store):
    """Issue 68, faults: sweeping tracking.uri left the points' runs naming a parent run in another
    store. A sweep's points and its parent run share one store: refused, one line, nothing written."""
    uri, db = new_store
    other = tmp_path / "other.db"
    result = run_cli(["experiment=smoke", *SMALL_MODEL, f"{uri},sqlite:///{other}"], tmp_path, flags=("-m",))
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("titan_exp: config error: tracking.uri=") and "share one store" in line
    assert not db.exists() and not other.exists() and not (tmp_path / "multirun").exists()


@pytest.mark.slow  # a real sweep killed mid-run (~40 s); sync's rules themselves: tests/unit/test_unit_sync_trust.py
def test_a_sweep_killed_outright_is_closed_by_sync_of_its_folder(tmp_path, store):
    """Issue 68, faults: the sweep's process SIGKILLed (alone: its points then get SIGTERM and end
    their runs) left its parent run RUNNING, and `sync` of a point's folder exited 1 (its rank0.log
    journaled relative to the sweep's working directory). Sync of a point's folder now finds
    everything, and sync of the sweep's folder ends the parent run KILLED with the reason."""
    from titan_exp.tracking import sync
    from titan_exp.tracking.parent_run import GONE_REASON

    uri, db = store
    command = [
        sys.executable, "-m", "titan_exp", "-m", "hydra.sweep.dir=multirun", "experiment=smoke", *SMALL_MODEL,
        "tracking=mlflow", uri, "launcher.device=cpu", "parallelism=single", "training.steps=5000", "debug.seed=0,1",
    ]  # fmt: skip
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})  # fmt: skip
    with stopped_for_good(proc, lambda proc: proc.kill()):
        deadline = time.monotonic() + 120
        while len(_runs_so_far(db)) < 2:  # both points are training
            assert time.monotonic() < deadline and proc.poll() is None, "the points never started"
            time.sleep(0.5)
    sweep = tmp_path / "multirun"
    deadline = time.monotonic() + 60
    while {run.info.status for run in _runs_so_far(db)} != {"KILLED"}:  # the points end their runs
        assert time.monotonic() < deadline, "the points never ended"
        time.sleep(0.5)
    assert sync.main([str(sweep / "0")]) == 0
    assert sync.main([str(sweep)]) == 0
    [parent] = mlflow_runs(db, sweeps=True)
    assert parent.info.status == "KILLED" and parent.data.tags["failure_reason"] == GONE_REASON
    assert {run.info.status for run in mlflow_runs(db)} == {"KILLED"}

"""Nothing tracked is lost: stores that cannot work are refused before any rank starts; rank 0
journals every record before the store sees it; what the store did not take (the writer killed, a
server down past the end of the run, rank 0 killed outright) is said, and replayed by the launching
process or by `python -m titan_exp sync`."""

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launchers.processes import process_alive
from launchers.rendezvous import free_port

from conftest import REPO, SMALL_MODEL, mlflow_client, mlflow_runs, run_cli, start_mlflow_server, stop_mlflow_server

RUN = ["data=synthetic", "training.seq_len=64", "training.local_batch_size=2", "metrics.log_freq=1"]
RUN += ["launcher.device=cpu", "launcher.nproc_per_node=2", *SMALL_MODEL]


@pytest.mark.parametrize(
    "override,expected",
    [
        ("tracking.uri=foo://x", "tracking.uri=foo://x: unsupported store; use sqlite:///"),
        ("tracking.uri=CORRUPT", "corrupt.db is not a SQLite database (its first bytes say otherwise)"),
        # Another application's database would get MLflow's tables; an in-memory one keeps nothing; a
        # device or a FIFO is no file to keep a store in (a FIFO's opening would block for ever).
        ("tracking.uri=OTHER_APP", "other.db is another application's SQLite database, not an MLflow store"),
        ("tracking.uri=sqlite:///:memory:", "a database in memory keeps nothing once the job ends"),
        ("tracking.uri='sqlite:///x.db?mode=memory'", "a database in memory keeps nothing once the job ends"),
        ("tracking.uri=sqlite:////dev/null", "/dev/null is a character device, not a regular file"),
        ("tracking.uri=FIFO", "fifo.db is a FIFO, not a regular file"),
        ("tracking.uri=http://127.0.0.1:PORT", "no MLflow server answers at http://127.0.0.1:PORT/health"),
        ("tracking.uri=", "tracking.uri='': must name a store"),
        ("tracking.experiment=", "tracking.experiment='': must name an MLflow experiment"),
        ("tracking.uri=sqlite:////proc/titan/mlflow.db", "tracking.uri=sqlite:////proc/titan/mlflow.db: cannot write"),
    ],
)
def test_a_store_that_cannot_work_is_refused_before_any_rank_starts(tmp_path, override, expected):
    corrupt, port = tmp_path / "corrupt.db", str(free_port())
    corrupt.write_bytes(b"these bytes are not a database" * 100)
    with contextlib.closing(sqlite3.connect(tmp_path / "other.db")) as other:
        other.execute("CREATE TABLE notes (text)")
        other.commit()
    other_bytes = (tmp_path / "other.db").read_bytes()
    os.mkfifo(tmp_path / "fifo.db")
    for name, path in (("CORRUPT", corrupt), ("OTHER_APP", tmp_path / "other.db"), ("FIFO", tmp_path / "fifo.db")):
        override = override.replace(name, f"sqlite:///{path}")
    override = override.replace("PORT", port)
    started = time.monotonic()
    result = run_cli([*RUN, "tracking=mlflow", override], tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    [line] = result.stderr.strip().splitlines()
    assert expected.replace("PORT", port) in line
    assert time.monotonic() - started < 30  # no retries for minutes
    assert not (tmp_path / "run" / "ranks").exists()
    assert not (tmp_path / "run" / "tracking_journal.jsonl").exists()
    assert (tmp_path / "other.db").read_bytes() == other_bytes


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process below `pid`."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        for child in children:
            try:
                found.append((child, (Path("/proc") / str(child) / "cmdline").read_bytes().decode(errors="replace")))
            except OSError:
                continue
        frontier = children
    return found


def _start(tmp_path: Path, overrides: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "titan_exp", f"hydra.run.dir={tmp_path}/run", *RUN, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_until_step(proc: subprocess.Popen, step: int) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"step {step:5d}"):
            return lines
    pytest.fail("the job ended before step {step}: " + "".join(lines)[-2000:])


def _sync(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "titan_exp", "sync", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def _logged_steps(db: Path, run_id: str) -> list[int]:
    return [m.step for m in mlflow_client(db).get_metric_history(run_id, "loss/global_avg")]


def _say_so_and_sync(proc, out: str, err: str, job_dir: Path, db: Path, steps: int) -> None:
    """The job exits 1 naming the journal and the sync command; sync writes the rest in, twice over
    adds nothing."""
    assert proc.returncode == 1, out[-2000:] + err[-2000:]
    said = err.strip().splitlines()[-1]
    assert "the MLflow store did not take all of this run's records" in said, err
    assert f"python -m titan_exp sync {job_dir}" in said and str(job_dir / "tracking_journal.jsonl") in said
    synced = _sync(str(job_dir))
    assert synced.returncode == 0, synced.stderr
    added = int(re.search(r"(\d+) metric value\(s\) added", synced.stdout)[1])
    assert added > 0 and "ended FINISHED" in synced.stdout, synced.stdout
    [run] = mlflow_runs(db)
    assert run.info.status == "FINISHED"
    assert _logged_steps(db, run.info.run_id) == list(range(1, steps + 1))
    again = _sync(str(job_dir.parent))  # a folder above the job finds its journal too
    # It ended holding all of the journal: left as it is.
    assert again.returncode == 0 and "ended FINISHED before, left as it is" in again.stdout, again.stdout + again.stderr
    assert _logged_steps(db, run.info.run_id) == list(range(1, steps + 1))


def test_a_killed_writer_loses_nothing_the_job_says_so_and_sync_replays_it(tmp_path, store):
    uri, db = store
    proc = _start(tmp_path, ["training.steps=15", uri])
    try:
        _read_until_step(proc, 3)
        writers = [pid for pid, cmdline in _descendants(proc.pid) if "spawn_main" in cmdline]
        assert len(writers) == 1, _descendants(proc.pid)
        os.kill(writers[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    _say_so_and_sync(proc, out, err, tmp_path / "run", db, steps=15)


@pytest.mark.slow  # ~40 s: two server start-ups (the killed writer above covers the journal in the default run)
def test_a_server_down_past_the_end_of_the_run_loses_nothing(tmp_path):
    db, port = tmp_path / "server.db", free_port()
    server = start_mlflow_server(db, port, tmp_path / "server.log")
    try:
        uri = f"tracking.uri=http://127.0.0.1:{port}"
        proc = _start(tmp_path, ["training.steps=20", uri, "tracking.close_timeout_s=5"])
        try:
            _read_until_step(proc, 3)
            stop_mlflow_server(server)
            out, err = proc.communicate(timeout=240)
        finally:
            proc.kill()
        server = start_mlflow_server(db, port, tmp_path / "server.log")
        _say_so_and_sync(proc, out, err, tmp_path / "run", db, steps=20)
    finally:
        stop_mlflow_server(server)


def test_rank0_killed_outright_its_last_steps_and_log_reach_the_store(tmp_path, store):
    uri, db = store
    proc = _start(tmp_path, ["training.steps=2000", uri])
    try:
        printed = _read_until_step(proc, 8)
        [rank0] = (tmp_path / "run" / "ranks").glob("*_0.pid")
        os.kill(int(rank0.read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "rank 0 failed" in err, err
    [run] = mlflow_runs(db)
    assert run.info.status == "FAILED"
    printed_steps = [int(m[1]) for line in printed + out.splitlines() if (m := re.match(r"step +(\d+)", line))]
    logged = _logged_steps(db, run.info.run_id)
    assert logged[: len(printed_steps)] == printed_steps, (logged, printed_steps)  # every step it printed
    artifacts = db.parent / "mlartifacts" / "titan_exp" / run.info.run_id / "artifacts"
    assert f"step {printed_steps[-1]:5d}" in (artifacts / "logs" / "rank0.log").read_text()


@pytest.mark.slow  # a job killed mid-run, then sync (the lock itself: tests/unit/test_unit_sync_trust.py)
def test_a_job_killed_outright_with_all_its_ranks_is_ended_killed_by_sync(tmp_path, store):
    """Issue 47 item 6: the launching process and every rank SIGKILLed at once leave nobody to end
    the run; no process holds the journal's lock any more, so `sync` ends it KILLED with the reason,
    as of its last metric, and a second sync changes nothing."""
    from titan_exp.tracking.journal import GONE_REASON

    uri, db = store
    proc = _start(tmp_path, ["training.steps=2000", uri])
    try:
        _read_until_step(proc, 5)
        everyone = [proc.pid, *(pid for pid, _ in _descendants(proc.pid))]
        for pid in everyone:
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    deadline = time.monotonic() + 30
    while any(process_alive(pid) for pid in everyone) and time.monotonic() < deadline:
        time.sleep(0.2)
    synced = _sync(str(tmp_path / "run"))
    assert synced.returncode == 0 and "ended KILLED" in synced.stdout, synced.stdout + synced.stderr
    [run] = mlflow_runs(db)
    assert run.info.status == "KILLED" and run.data.tags["failure_reason"] == GONE_REASON
    last_loss = max(m.timestamp for m in mlflow_client(db).get_metric_history(run.info.run_id, "loss/global_avg"))
    assert last_loss <= run.info.end_time < last_loss + 5000  # as of its last metric, not of the sync
    again = _sync(str(tmp_path / "run"))
    assert again.returncode == 0 and "ended KILLED before, left as it is" in again.stdout, again.stdout

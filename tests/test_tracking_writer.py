"""Rank 0's MLflow writer process on its own: every queued step arrives, and it gives the ranks the
cores once training starts."""

import logging
import os
import time
from pathlib import Path

from titan_exp.tracking.config import TrackingConfig
from titan_exp.tracking.run import now_ms
from titan_exp.tracking.store import client, ensure_store
from titan_exp.tracking.writer import BackgroundTracker


def test_tracker_writes_every_queued_step_from_its_own_process(tmp_path):
    cfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db")
    ensure_store(cfg)
    tracker = BackgroundTracker(cfg, "burst", {"model": "test"}, (tmp_path / "run_id",))
    tracker.log_params({"a.b": 1})
    for step in range(1, 301):  # far faster than one log_batch each: the writer merges them
        tracker.log_metrics(step, {"loss": 1.0 / step, "lr": 0.1})
    tracker.close("FINISHED")
    store = client(cfg.uri)
    run = store.get_run((tmp_path / "run_id").read_text())
    assert run.info.status == "FINISHED" and run.data.params == {"a.b": "1"} and run.data.tags["status"] == "finished"
    history = sorted((m.step, m.value) for m in store.get_metric_history(run.info.run_id, "loss"))
    assert history == [(step, 1.0 / step) for step in range(1, 301)]


def test_tracker_starts_at_normal_priority_steps_down_when_training_starts_and_can_be_paused(tmp_path):
    def stopped(pid: int) -> bool:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"

    def becomes(pid: int, want_stopped: bool) -> bool:  # a signalled process stops (or continues) a moment later
        deadline = time.monotonic() + 10
        while stopped(pid) != want_stopped and time.monotonic() < deadline:
            time.sleep(0.01)
        return stopped(pid) == want_stopped

    cfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db")
    ensure_store(cfg)
    tracker = BackgroundTracker(cfg, "priority", {}, (tmp_path / "run_id",))
    pid = tracker._process.pid
    # Its start-up competes on equal terms with the rank's own.
    assert os.sched_getscheduler(pid) == os.SCHED_OTHER
    with tracker.paused():
        assert becomes(pid, want_stopped=True)
    assert becomes(pid, want_stopped=False)
    tracker.log_metrics(1, {"loss": 1.0})  # the first step's metrics: from here on, idle cores only
    deadline = time.monotonic() + 120
    while os.sched_getscheduler(pid) != os.SCHED_IDLE:
        assert time.monotonic() < deadline, "the writer never stepped down to SCHED_IDLE"
        time.sleep(0.2)
    tracker.close("FINISHED")
    assert (tmp_path / "run_id").exists()


def test_busy_store_messages_of_retried_calls_stay_quiet(tmp_path, capfd):
    """What MLflow's SQL store logs before raising "database is locked", which with_retries retries."""
    client(f"sqlite:///{tmp_path}/mlflow.db")
    capfd.readouterr()
    logger = logging.getLogger("mlflow.store.db.utils")
    logger.error("SQLAlchemy database error. The following exception is caught.\n%s", "database is locked")
    logger.error("SQLAlchemy database error. The following exception is caught.\n%s", "disk I/O error")
    logged = capfd.readouterr().err
    assert "disk I/O error" in logged and "database is locked" not in logged


def test_a_deferred_writer_starts_when_asked_and_a_run_that_ends_first_is_still_recorded(tmp_path):
    """Where CPU ranks take every core, the writer waits for the first step (tracking/writer.py)."""
    cfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db")
    ensure_store(cfg)
    asked_ms = now_ms()
    waiting = BackgroundTracker(cfg, "waits", {}, (tmp_path / "waits_id",), defer_start=True)
    waiting.log_params({"queued": "before the start"})
    with waiting.paused():  # nothing to pause yet
        pass
    time.sleep(1.0)
    assert waiting._process.pid is None and not (tmp_path / "waits_id").exists()
    started_ms = now_ms()
    waiting.start()
    waiting.start()  # once only
    waiting.close("FINISHED")
    closed_ms = now_ms()
    # One that never got to start() (a job that failed before its first step): close() starts it.
    failed = BackgroundTracker(cfg, "fails", {}, (tmp_path / "fails_id",), defer_start=True)
    failed.close("FAILED", "boom")
    store = client(cfg.uri)
    waited = store.get_run((tmp_path / "waits_id").read_text())
    assert waited.data.params == {"queued": "before the start"}
    # The run's span is the job's, not the writer's: it starts when asked for, a second before the writer.
    assert asked_ms <= waited.info.start_time < started_ms - 900 and waited.info.end_time <= closed_ms
    failed_run = store.get_run((tmp_path / "fails_id").read_text())
    assert failed_run.info.status == "FAILED" and failed_run.data.tags["failure_reason"] == "boom"


def test_a_run_that_ended_is_reopened_running_and_an_unknown_one_is_not(tmp_path):
    """How a job resumed from its checkpoint goes on in the run that saved it (after a failure, too)."""
    from titan_exp.tracking.config import TrackingConfig
    from titan_exp.tracking.run import MlflowRun

    cfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db")
    run = MlflowRun.create(cfg, "failed", {})
    run.finish("FAILED", "rank 1 failed: killed")
    reopened = MlflowRun.reopen(cfg.uri, run.run_id, "a-token")
    found = reopened.client.get_run(run.run_id)
    assert found.info.status == "RUNNING"
    assert found.data.tags["status"] == "running" and "failure_reason" not in found.data.tags
    assert MlflowRun.reopen(cfg.uri, "0" * 32, "a-token") is None


def test_a_reopened_run_keeps_its_first_attempts_params_and_takes_new_ones(tmp_path):
    """A requeued job logs its start again: a figure measured anew (a CPU's peak FLOP/s, measured
    under another load) keeps the first attempt's value, where MLflow would refuse the change and
    fail the run's tracking; keys it had not logged are written."""
    from titan_exp.tracking.config import TrackingConfig
    from titan_exp.tracking.run import MlflowRun

    cfg = TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db")
    run = MlflowRun.create(cfg, "requeued", {})
    run.log_params({"derived/peak_flops_per_device": 36.5e9, "model.dim": 64})
    run.finish("FAILED", "time limit")
    reopened = MlflowRun.reopen(cfg.uri, run.run_id, "a-token")
    reopened.log_params({"derived/peak_flops_per_device": 138.4e9, "model.dim": 64, "resumed_from": "step-50"})
    assert reopened.client.get_run(run.run_id).data.params == {
        "derived/peak_flops_per_device": str(36.5e9),
        "model.dim": "64",
        "resumed_from": "step-50",
    }


def test_a_store_locked_by_another_process_is_ridden_out_from_the_first_call(tmp_path):
    """Issue 47 item 8: opening a client reads the tables, and failed at once while another process
    held the store's exclusive lock (the job then exited 1 naming only SQLAlchemy's link). Every call,
    opening included, waits out the lock; the run is created once it ends."""
    import subprocess
    import sys
    import time

    from titan_exp.tracking.config import TrackingConfig
    from titan_exp.tracking.run import MlflowRun

    db = tmp_path / "mlflow.db"
    client(f"sqlite:///{db}")  # the store exists
    hold = "import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
    hold += "c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(2.5); c.execute('COMMIT')"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(db)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    started = time.monotonic()
    run = MlflowRun.create(TrackingConfig(uri=f"sqlite:///{db}"), "waited", {})
    waited = time.monotonic() - started
    assert holder.wait(timeout=30) == 0
    assert waited > 1.5 and run.client.get_run(run.run_id).info.run_name == "waited"


def test_a_run_id_file_is_written_whole_or_not_at_all(tmp_path):
    """Issue 47 item 7: a full disk during a save left a 0-byte mlflow_run_id. Here the disk is full
    for a process whose file-size limit is 0 (writes fail with EFBIG, as with ENOSPC): the id file
    keeps its old content, and a new one is not left empty."""
    import subprocess
    import sys

    (tmp_path / "old").write_text("a" * 32)
    write = (
        "import resource, signal, sys; from pathlib import Path; from titan_exp.tracking.run import write_run_id\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
        "for name in ('old', 'new'):\n"
        "    try: write_run_id(Path(sys.argv[1]) / name, 'b' * 32)\n"
        "    except OSError as err: print(name, err.errno)\n"
    )
    done = subprocess.run([sys.executable, "-c", write, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["old", "27", "new", "27"], done.stderr  # EFBIG
    assert (tmp_path / "old").read_text() == "a" * 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]

"""The start-up breakdown (metrics/startup.py), the rendezvous wait that keeps ranks from backing
off (launchers/env.py), and what a rank imports before training (start-up time)."""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from launchers.env import wait_for_rendezvous
from launchers.rendezvous import free_port
from titan_exp.metrics import startup


@pytest.fixture
def clean_marks(monkeypatch):
    monkeypatch.setattr(startup, "_marks", [])


def test_a_process_started_before_its_first_mark_and_the_phases_add_up_to_the_total(clean_marks):
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    after = time.time()
    try:
        # /proc counts in 10 ms ticks.
        assert before - 0.02 <= startup.process_start_time(child.pid) <= after + 0.02
    finally:
        child.kill()
        child.wait()
    assert startup.process_start_time() <= before
    startup.mark("python_imports")
    time.sleep(0.05)
    startup.mark("compose")
    phases = startup.phases()
    assert list(phases) == ["python_imports", "compose", "total"]
    assert phases["compose"] >= 0.05 and phases["python_imports"] > 0
    assert phases["total"] == pytest.approx(phases["python_imports"] + phases["compose"])
    assert set(startup.as_metrics()) == {"startup/python_imports_s", "startup/compose_s", "startup/total_s"}
    line = startup.summary_line()
    assert line.startswith(f"start-up: {phases['total']:.2f} s to the end of the first step = python_imports ")


def test_the_clock_starts_with_the_interpreter_not_with_the_shell_that_execs_it():
    """bash execs its last command, whose process keeps the shell's creation: the sleep before it is
    no start-up of ours, while the interpreter's own start before titan_exp's first line is."""
    code = (
        "import titan_exp; from titan_exp.metrics import startup; startup.mark('python_imports'); "
        "print(startup.carried()[0][1], titan_exp.REACHED[0])"
    )
    before = time.time()
    result = subprocess.run(
        ["bash", "-c", 'sleep 3 && "$0" -c "$1"', sys.executable, code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    origin, reached = map(float, result.stdout.split())
    assert before + 3 <= origin < reached


def test_a_rank_continues_the_launching_process_marks_from_its_own_creation(clean_marks):
    launched_at = time.time() - 5.0
    startup.adopt((("origin", launched_at), ("store", launched_at + 1.0)))
    startup.mark("rank_imports")
    phases = startup.phases()
    assert list(phases) == ["store", "spawn", "rank_imports", "total"]
    # This process was created before the test ran: the spawn phase ends at its creation.
    assert phases["spawn"] == pytest.approx(startup.process_start_time() - (launched_at + 1.0), abs=0.05)
    assert phases["total"] == pytest.approx(time.time() - launched_at, abs=0.05)


def test_the_rendezvous_wait_returns_once_rank_0_listens(monkeypatch):
    port = free_port()  # below the ephemeral range: a connection to it cannot connect to itself
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    start = time.monotonic()
    wait_for_rendezvous(timeout_s=0.3)  # nobody listens: gives up after the timeout
    assert 0.3 <= time.monotonic() - start < 2.0

    server = socket.socket()

    def listen_later() -> None:
        time.sleep(0.5)
        server.bind(("127.0.0.1", port))
        server.listen()

    start = time.monotonic()  # before the thread's sleep starts, or the wait may look shorter than it
    threading.Thread(target=listen_later).start()
    wait_for_rendezvous(timeout_s=30)
    assert 0.5 <= time.monotonic() - start < 5.0
    server.close()


def test_the_rendezvous_wait_skips_a_rendezvous_without_master_address(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    start = time.monotonic()
    wait_for_rendezvous(timeout_s=30)
    assert time.monotonic() - start < 0.1


def test_a_rank_imports_no_memory_tracker_before_an_audit():
    """MemTracker pulls in torch._inductor (~0.5 s of a rank's start-up): audited jobs only."""
    code = "import sys, titan_exp.train.trainer; print('torch._inductor' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_further_job_of_the_same_process_starts_its_own_clock(clean_marks):
    startup.mark("python_imports")
    time.sleep(0.2)
    startup.restart()  # a parity run's next layout
    startup.mark("compose")
    assert list(startup.phases()) == ["compose", "total"] and startup.phases()["total"] < 0.1

"""Placement: failures propagate, nothing is left running, external launchers are not spawned again."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from launchers.base import JobSpec, Placement
from launchers.local import LocalLauncher, LocalOptions
from launchers.processes import process_alive
from launchers.tasks import RankFailure

from conftest import REPO, SMALL_MODEL, mlflow_client, mlflow_runs, run_cli, start_as_in_a_terminal, stopped_for_good

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def launch_local(fn, arg, nproc: int, folder: Path, heartbeat_timeout_s: float = 60.0):
    """fn(arg) in `nproc` CPU ranks placed by launcher=local (one thread each), followed to the end."""
    placement = Placement("local", "cpu", nproc, 1, 1)
    spec = JobSpec("test", placement, timeout_min=5, heartbeat_timeout_s=heartbeat_timeout_s, resumable=False)
    placed = LocalLauncher(LocalOptions()).place(fn, arg, spec, folder, lambda line: print(line, flush=True))
    return placed.follow()


def _rank_pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in folder.glob("*.pid")]


def _processes_using(folder: Path) -> list[int]:
    """Live processes whose command line names `folder`: submitit's controller and task processes do."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(folder) in cmdline.read_bytes().decode(errors="replace") and process_alive(int(cmdline.parent.name)):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def fail_on_rank_1(seconds: float) -> int:
    rank = int(os.environ["RANK"])
    if rank == 1:
        raise ValueError("rank one gives up")
    time.sleep(seconds)  # the others would wait this long: they must be stopped, not waited for
    return rank


def echo_rank(_: None) -> str:
    print(f"hello from rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}", flush=True)
    return os.environ["RANK"]


def test_ranks_get_the_torch_distributed_environment(tmp_path, capsys):
    result = launch_local(echo_rank, None, 3, tmp_path)
    assert result == "0"  # rank 0's return value
    out = capsys.readouterr().out
    assert "hello from rank 0 of 3" in out
    assert "rank 1" not in out  # only rank 0's output is streamed; the others are in their logs
    assert any("hello from rank 2 of 3" in p.read_text() for p in tmp_path.glob("*_2_log.out"))


def test_exception_in_one_rank_stops_all_and_names_the_rank(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        launch_local(fail_on_rank_1, 120.0, 3, tmp_path)
    assert err.value.rank == 1
    assert "ValueError: rank one gives up" in str(err.value)
    assert time.monotonic() - start < 60
    assert not any(process_alive(pid) for pid in _rank_pids(tmp_path))
    assert _processes_using(tmp_path) == []


def stop_on_rank_1(seconds: float) -> int:
    rank = int(os.environ["RANK"])
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # as a debugger, a ^Z or a hung host would
    time.sleep(seconds)  # the healthy ranks wait: their heartbeats go on
    return rank


def crash_on_rank_1(seconds: float) -> int:
    rank = int(os.environ["RANK"])
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # as a bad kernel or extension would
    time.sleep(seconds)
    return rank


def test_a_crashed_rank_is_named_by_its_crash(tmp_path):
    with pytest.raises(RankFailure) as err:
        launch_local(crash_on_rank_1, 120.0, 2, tmp_path)
    assert err.value.rank == 1
    assert err.value.reason.startswith("exited without a result: crashed: Segmentation fault"), err.value.reason


def test_a_stopped_rank_is_named_by_its_heartbeat_and_nothing_is_left(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        launch_local(stop_on_rank_1, 300.0, 3, tmp_path, heartbeat_timeout_s=8)
    assert err.value.rank == 1
    assert "no heartbeat for" in err.value.reason
    assert time.monotonic() - start < 60  # not the 300 s the others wait, nor a collective's timeout
    assert not any(process_alive(pid) for pid in _rank_pids(tmp_path))
    assert _processes_using(tmp_path) == []


LONG_RUN = [
    *SMALL_MODEL,
    "data=synthetic",
    "training.steps=2000",
    "training.seq_len=64",
    "training.local_batch_size=2",
    "metrics.log_freq=1",
    "launcher.device=cpu",
]


def _start_two_ranks(tmp_path, uri: str, **popen) -> subprocess.Popen:
    """LONG_RUN on 2 local ranks, its step lines on the pipe `proc.stdout`."""
    command = [
        sys.executable,
        "-m",
        "titan_exp",
        f"hydra.run.dir={tmp_path}/run",
        *LONG_RUN,
        "launcher.nproc_per_node=2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*command, *uri.split()], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, **popen)


@pytest.mark.parametrize(
    "sig,reason",
    [
        (signal.SIGKILL, "exited without a result: killed by SIGKILL"),
        # The heartbeat's 20 s (the rule's least) waited out through the command line: slow; the
        # default suite names a stopped rank by its heartbeat in-process (above, 8 s).
        pytest.param(signal.SIGSTOP, "no heartbeat for", marks=pytest.mark.slow),
    ],
)
def test_killed_or_stopped_rank_fails_the_run_and_leaves_no_process(tmp_path, store, sig, reason):
    uri, db = store
    proc = _start_two_ranks(tmp_path, f"{uri} launcher.heartbeat_timeout_s=20", stderr=subprocess.PIPE)
    try:
        for line in proc.stdout:
            if line.startswith("step     3"):
                break
        [victim_file] = (tmp_path / "run" / "ranks").glob("*_1.pid")
        victim = int(victim_file.read_text())
        start = time.monotonic()
        os.kill(victim, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert "rank 1 failed" in err and reason in err, err
    assert time.monotonic() - start < 75  # a stopped rank: the heartbeat's 20 s, not gloo's minutes
    assert not any(process_alive(pid) for pid in _rank_pids(tmp_path / "run" / "ranks"))
    assert _processes_using(tmp_path / "run" / "ranks") == []
    [run] = mlflow_runs(db)
    assert run.info.status == "FAILED"
    assert run.data.tags["status"] == "failed" and "rank 1 failed" in run.data.tags["failure_reason"]
    # What was logged before the failure is kept, rank 0's console output included.
    assert run.data.metrics["loss/global_avg"] > 0
    # Artifacts live beside the SQLite store.
    run_log = (
        db.parent / "mlartifacts" / "titan_exp" / run.info.run_id / "artifacts" / "logs" / "rank0.log"
    ).read_text()
    assert "step     3" in run_log


def test_torchrun_started_ranks_train_without_spawning_again(tmp_path, store):
    uri, db = store
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m"]
    smoke = ["experiment=smoke", "tracking=mlflow", uri, "launcher.device=cpu", *SMALL_MODEL]
    result = run_cli(smoke, tmp_path, launcher=torchrun)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step     6" in result.stdout
    assert not list(tmp_path.rglob("ranks"))  # our launcher never ran
    [run] = mlflow_runs(db)
    assert run.info.status == "FINISHED" and run.data.tags["launcher"] == "torchrun"
    assert run.data.tags["world_size"] == "2"


@pytest.mark.parametrize(
    "launcher,stop,reason",
    [
        # Ctrl-C in a terminal: SIGINT to every process of the foreground group.
        (
            [sys.executable, "-m", "titan_exp", "launcher.nproc_per_node=2"],
            lambda proc: os.killpg(proc.pid, signal.SIGINT),
            "KeyboardInterrupt",
        ),
        # kill: SIGTERM to the launching process alone; it stops its ranks.
        (
            [sys.executable, "-m", "titan_exp", "launcher.nproc_per_node=2"],
            lambda proc: proc.send_signal(signal.SIGTERM),
            "SIGTERM",
        ),
        # A stopped torchrun job: its agent passes SIGTERM on to the ranks (srun/scancel do the same).
        (
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "titan_exp"],
            lambda proc: proc.send_signal(signal.SIGTERM),
            "SIGTERM",
        ),
    ],
    ids=["ctrl_c_local", "sigterm_local", "sigterm_torchrun"],
)
def test_interrupted_job_ends_its_run_killed_keeping_what_was_logged(tmp_path, store, launcher, stop, reason):
    uri, db = store
    command = [*launcher, f"hydra.run.dir={tmp_path}/run", *LONG_RUN, uri]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = start_as_in_a_terminal(command, stdout=subprocess.PIPE, stderr=stderr)
    # Every process of the job ends (the MLflow writer included), not merely its launcher.
    with stopped_for_good(proc, stop):
        for line in proc.stdout:
            if line.startswith("step     5"):
                break
    assert proc.returncode != 0
    [run] = mlflow_runs(db)
    assert run.info.status == "KILLED", run.data.tags
    assert run.data.tags["status"] == "killed" and reason in run.data.tags["failure_reason"]
    steps = [m.step for m in mlflow_client(db).get_metric_history(run.info.run_id, "loss/global_avg")]
    assert steps[:5] == [1, 2, 3, 4, 5]  # what was logged before stays
    if launcher[2] == "titan_exp":  # our own launching process: one line, a shell's status for the signal
        signal_name = "SIGINT" if reason == "KeyboardInterrupt" else "SIGTERM"
        said = (tmp_path / "stderr.txt").read_text().strip().splitlines()[-1]
        assert said == f"titan_exp: stopped by {signal_name}; run {run.info.run_id} ended KILLED"
        assert "Traceback" not in (tmp_path / "stderr.txt").read_text()
        assert proc.returncode == 128 + signal.Signals[signal_name]


def test_ranks_stop_when_the_launching_process_is_killed_outright(tmp_path, store):
    uri, db = store
    proc = _start_two_ranks(tmp_path, uri)
    try:
        for line in proc.stdout:
            if line.startswith("step     5"):
                break
        proc.kill()  # kill -9: no word to the ranks
        proc.wait()
        deadline = time.monotonic() + 60
        while _processes_using(tmp_path / "run" / "ranks"):
            assert time.monotonic() < deadline, "ranks outlived their launcher"
            time.sleep(0.2)
    finally:
        proc.kill()
    [run] = mlflow_runs(db)
    assert run.info.status == "KILLED", run.data.tags
    assert "LauncherDied: the launching process" in run.data.tags["failure_reason"]
    steps = [m.step for m in mlflow_client(db).get_metric_history(run.info.run_id, "loss/global_avg")]
    assert steps[:5] == [1, 2, 3, 4, 5]


# A rank whose launcher is killed while its main thread is inside a __del__ (the watcher's interrupt
# raises there, and Python only prints it), or while it handles a peer's failure.
_RANK_WHOSE_LAUNCHER_DIES = """
import subprocess, sys, time
from launchers.processes import LAUNCHER_WATCH_SECONDS, stop_if_launcher_gone, stop_when_gone

launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
stop_when_gone(launcher.pid)

def launcher_dies_meanwhile():
    launcher.kill()
    launcher.wait()
    end = time.monotonic() + 3 * LAUNCHER_WATCH_SECONDS
    while time.monotonic() < end:  # the watcher's interrupt lands here
        pass

class Step:
    def __init__(self, last_of_the_launcher):
        self.last_of_the_launcher = last_of_the_launcher

    def __del__(self):
        if self.last_of_the_launcher:
            launcher_dies_meanwhile()

if sys.argv[1] == "a peer fails first":
    try:
        raise RuntimeError("a collective failed: the peer is gone")
    except RuntimeError:
        launcher_dies_meanwhile()
        print("the failure was recorded", flush=True)
        raise
for step in range(1, 11):
    Step(last_of_the_launcher=step == 3)
    if sys.argv[1] == "checks between steps":
        stop_if_launcher_gone()
    print(f"step {step}", flush=True)
print("trained to the end", flush=True)
"""


@pytest.mark.parametrize("case", ["checks between steps", "does not check", "a peer fails first"])
def test_a_rank_whose_launcher_dies_stops_and_records_why(case):
    proc = subprocess.run(
        [sys.executable, "-c", _RANK_WHOSE_LAUNCHER_DIES, case], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    last_error = proc.stderr.rstrip().splitlines()[-1]
    if case == "a peer fails first":  # the handler is not cut short by a second exception
        assert proc.stdout == "the failure was recorded\n" and "LauncherDied" not in proc.stderr, proc.stderr
        assert last_error == "RuntimeError: a collective failed: the peer is gone"
        return
    assert "Exception ignored" in proc.stderr and "LauncherDied" in proc.stderr, proc.stderr  # lost
    if case == "checks between steps":  # as the trainer does
        assert proc.returncode == 1 and proc.stdout.split() == ["step", "1", "step", "2"]
        assert last_error.startswith("launchers.signals.LauncherDied: the launching process")
    else:  # what the check is there for
        assert proc.returncode == 0 and "trained to the end" in proc.stdout

"""launcher=ray without a cluster to talk to: refused in one line before anything is written (the
cluster tests, tests/test_ray.py, start a real one); and a job API that is no cluster (issue 68's
probe, tests/ray_fake_api.py) runs nothing in the launching process."""

import base64
import os
import pickle
import socket
import time

from launchers.rendezvous import free_port

from conftest import SMALL_MODEL, run_cli
from ray_fake_api import FakeJobApi, message


def test_a_cluster_that_does_not_answer_is_refused_in_one_line_and_nothing_is_written(tmp_path):
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store = tmp_path / "mlflow.db"
    job = ["launcher=ray", f"launcher.address={address}", "launcher.device=cpu", "launcher.nproc_per_node=2"]
    done = run_cli([*job, *SMALL_MODEL, f"tracking.uri=sqlite:///{store}"], tmp_path, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    said = f"titan_exp: config error: launcher=ray: no Ray cluster answers at launcher.address={address}"
    assert line.startswith(said), line
    assert "ray start --head" in line, line
    assert not store.exists() and not (tmp_path / "run" / "ray").exists()


def test_an_address_that_takes_the_connection_and_never_answers_is_refused_in_one_line(tmp_path):
    store = tmp_path / "mlflow.db"
    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:  # the kernel takes connections
        address = f"http://127.0.0.1:{silent.getsockname()[1]}"
        job = ["launcher=ray", f"launcher.address={address}", "launcher.device=cpu", "launcher.nproc_per_node=2"]
        started = time.monotonic()
        done = run_cli([*job, *SMALL_MODEL, f"tracking.uri=sqlite:///{store}"], tmp_path, timeout=120)
        seconds = time.monotonic() - started
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    said = f"titan_exp: config error: launcher=ray: no Ray cluster answers at launcher.address={address}"
    assert line.startswith(said) and "timed out" in line, line
    assert seconds < 30, seconds
    assert not store.exists() and not (tmp_path / "run").exists()


class _Runs:
    """Unpickled, it runs a shell command (the probe's payload)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_result_from_a_job_api_runs_nothing_and_ends_the_run_in_one_line(tmp_path):
    marker = tmp_path / "ran"
    line = message(result=base64.b64encode(pickle.dumps(_Runs(marker))).decode())  # the form of old
    with FakeJobApi(log=line + "\n").running() as api:
        job = ["launcher=ray", f"launcher.address={api.address}", "launcher.device=cpu", "launcher.nproc_per_node=2"]
        done = run_cli([*job, *SMALL_MODEL, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"], tmp_path, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    [said] = done.stderr.strip().splitlines()
    assert said.startswith("titan_exp: run failed: MalformedMessage: Ray job titan_exp-"), said
    assert said.endswith("ended FAILED"), said
    assert not marker.exists()

"""launcher=ray without a cluster to talk to: refused in one line before anything is written (the
cluster tests, tests/test_ray.py, start a real one)."""

from launchers.rendezvous import free_port

from conftest import SMALL_MODEL, run_cli


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

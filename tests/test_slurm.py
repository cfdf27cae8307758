"""Ranks started by srun on a real one-node Slurm cluster (Debian's slurm-wlm + munge) that this
module starts and stops."""

import os
import subprocess

import pytest

from launchers.env import free_port

from conftest import REPO, mlflow_runs

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port())}
    script = REPO / "tests" / "slurm" / "cluster.sh"
    started = subprocess.run(
        ["bash", str(script), "start", str(state)], env=env, capture_output=True, text=True, timeout=120
    )
    assert started.returncode == 0, f"could not start Slurm (run ./setup.sh --test): {started.stderr}"
    yield {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "OMP_NUM_THREADS": "1"}
    subprocess.run(["bash", str(script), "stop", str(state)], timeout=60)


def test_srun_started_ranks_train_without_spawning_again(slurm_env, tmp_path, store):
    uri, db = store
    command = [
        # --overcommit: two ranks even on a one-core node; --immediate: fail instead of queueing forever.
        "srun",
        "--ntasks=2",
        "--overcommit",
        "--immediate=60",
        "--time=10",
        "python",
        "-m",
        "titan_exp",
        f"hydra.run.dir={tmp_path}/run",
        "experiment=smoke",
        "tracking=mlflow",
        uri,
        "launcher.device=cpu",
    ]
    result = subprocess.run(command, cwd=REPO, env=slurm_env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "step     6" in result.stdout
    assert not (tmp_path / "run" / "ranks").exists()  # our local launcher never ran
    [run] = mlflow_runs(db)
    assert run.info.status == "FINISHED"
    assert run.data.tags["launcher"] == "srun" and run.data.tags["world_size"] == "2"
    assert run.data.tags["slurm_job_id"].isdigit()

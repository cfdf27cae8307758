"""launcher=ray on a real Ray cluster (tests/ray/ray_cluster.sh): a head and two workers as network
namespaces of this machine, each running Ray's own daemons, started once for the module and removed
after it. Jobs are submitted from this machine (the root namespace) to the head's job API, as from a
laptop to a KubeRay cluster; the ranks talk over gloo between the namespaces. The file system is
shared, but for one folder each worker has to itself (a disk the ranks' nodes do not share)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest
import torch

from launchers.base import JobSpec, Placement
from launchers.ray import RayLauncher
from launchers.tasks import RankFailure
from titan_exp.compare.runs import loss_curve as steps_and_losses

from conftest import (
    REPO,
    SMALL_MODEL,
    loss_curve,
    mlflow_client,
    mlflow_runs,
    processes_naming,
    run_cli,
    store_in,
    wait_for_output,
)
from ray_cluster import WORKERS, RayTestCluster

pytestmark = pytest.mark.ray
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks run this module's functions

# Deterministic FSDP over CPU ranks, every step's loss logged; the layout comes from the test.
JOB = [
    "debug=deterministic", "data=synthetic", "training.seq_len=64", "training.local_batch_size=2",
    "metrics.log_freq=1", "launcher.device=cpu", "parallelism=fsdp", "training.steps=6", *SMALL_MODEL,
]  # fmt: skip
TWO_NODES = ["launcher.nodes=2", "launcher.nproc_per_node=1"]
RTOL = 1e-4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[RayTestCluster]:
    """The cluster; once stopped, nothing of it runs (no process names its folder) and its
    namespaces are gone."""
    state = tmp_path_factory.mktemp("ray_cluster")
    started = RayTestCluster.start(state)
    try:
        yield started
    finally:
        started.stop()
    assert not processes_naming(state), processes_naming(state)
    assert not [name for name in _namespaces() if name.startswith(f"tr{(state / 'tag').read_text().strip()}-")]


def _on_ray(cluster: RayTestCluster) -> list[str]:
    return ["launcher=ray", f"launcher.address={cluster.address}", "launcher.timeout_min=10"]


@pytest.fixture(scope="module")
def one_node_sweep(cluster, tmp_path_factory, migrated_store) -> tuple[subprocess.CompletedProcess, Path]:
    """A sweep of two points, each FSDP over one Ray node's 2 ranks (seeds 0 and 1): its output and store."""
    folder = tmp_path_factory.mktemp("one_node_sweep")
    uri, db = store_in(folder, migrated_store)
    points = ["launcher.nodes=1", "launcher.nproc_per_node=2", "debug.seed=0,1"]
    return run_cli([*JOB, *_on_ray(cluster), *points, uri], folder, flags=("-m",)), db


@pytest.fixture(scope="module")
def one_node_curve(one_node_sweep) -> list[float]:
    """The loss curve of the 2-node layout (FSDP over 2 ranks, seed 0) as one Ray node's 2 ranks."""
    done, db = one_node_sweep
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    [run] = [run for run in mlflow_runs(db) if run.data.params["debug.seed"] == "0"]
    return loss_curve(db, run.info.run_id)


def _place(cluster: RayTestCluster, fn, arg, folder: Path, nodes: int = 2, heartbeat_timeout_s: float = 60.0):
    """fn(arg) in one CPU rank on each of `nodes` Ray nodes, through the launcher's seam; rank 0's result."""
    section = _options(address=cluster.address)
    spec = JobSpec("test", Placement("ray", "cpu", 1, nodes, 1), 5, heartbeat_timeout_s, resumable=False)
    placed = RayLauncher(section).place(fn, arg, spec, folder, lambda line: print(line, flush=True))
    return placed.follow()


def _options(**values):
    from titan_exp.config.sections import LAUNCHER_SECTIONS

    return LAUNCHER_SECTIONS["ray"](**values)


def echo_rank(_: None) -> str:
    print(f"hello from rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} on {os.uname().nodename}", flush=True)
    return os.environ["RANK"]


def fail_on_rank_1(seconds: float) -> int:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one gives up")
    time.sleep(seconds)  # the others would wait this long: they must be stopped, not waited for
    return 0


def stop_on_rank_1(seconds: float) -> int:
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSTOP)  # as a debugger or a hung host would
    time.sleep(seconds)
    return 0


def test_each_rank_gets_its_place_and_its_output_comes_back_to_the_job_folder(cluster, tmp_path, capsys):
    assert _place(cluster, echo_rank, None, tmp_path) == "0"
    out = capsys.readouterr().out
    assert re.search(r"^hello from rank 0 of 2 on rw[12]$", out, re.M), out
    assert "rank 1 of" not in out  # only rank 0's output is on the console; every rank's is in its log
    assert re.search(r"hello from rank 1 of 2 on rw[12]", (tmp_path / "1_log.out").read_text())
    hosts = {re.search(r"on (rw\d)", (tmp_path / f"{rank}_log.out").read_text()).group(1) for rank in range(2)}
    assert hosts == set(WORKERS)  # STRICT_SPREAD: one node each


def test_a_rank_that_raises_fails_the_job_with_its_error_and_the_others_are_stopped(cluster, tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        _place(cluster, fail_on_rank_1, 120.0, tmp_path)
    assert err.value.rank == 1 and "ValueError: rank one gives up" in err.value.reason, err.value
    assert "Traceback" in (tmp_path / "1_log.out").read_text()
    assert time.monotonic() - start < 60
    assert not any(cluster.rank_processes(node) for node in WORKERS)


def test_a_stopped_rank_is_named_by_its_heartbeat_and_its_node(cluster, tmp_path):
    with pytest.raises(RankFailure) as err:
        _place(cluster, stop_on_rank_1, 120.0, tmp_path, heartbeat_timeout_s=8)
    assert err.value.rank == 1
    assert re.match(r"stopped answering: no heartbeat for \d+ s from 10\.\d+\.\d+\.1[12] ", err.value.reason), err.value
    assert not any(cluster.rank_processes(node) for node in WORKERS)


def test_two_node_fsdp_job_on_ray_trains_as_on_one_node(cluster, one_node_curve, tmp_path, store):
    """Two Ray nodes, one rank each: the same loss curve as one node's two ranks; the run names its
    Ray job; every rank's output is in the job folder."""
    uri, db = store
    done = run_cli([*JOB, *_on_ray(cluster), *TWO_NODES, uri], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    submission = re.search(r"^Ray job (titan_exp-\S+) submitted to http://\S+: 2 ranks on 2 node", done.stdout, re.M)
    assert submission, done.stdout
    assert re.search(r"^titan_exp: ranks placed by Ray: rank 0 on [\d.]+, rank 1 on [\d.]+$", done.stdout, re.M)
    [run] = mlflow_runs(db)
    assert run.info.status == "FINISHED", run.data.tags
    tags = run.data.tags
    assert tags["launcher"] == "ray" and tags["ray_job_id"] == submission.group(1), tags
    assert sorted(tags["hosts"].split(",")) == list(WORKERS), tags
    torch.testing.assert_close(loss_curve(db, run.info.run_id), one_node_curve, rtol=RTOL, atol=0)
    assert "step     6" in (tmp_path / "run" / "ray" / "0_log.out").read_text()


def test_hsdp_on_ray_replicates_across_the_nodes_and_shards_within_each(cluster, tmp_path, store):
    uri, db = store
    layout = ["parallelism=hsdp", "launcher.nodes=2", "launcher.nproc_per_node=2"]
    done = run_cli([*JOB, *_on_ray(cluster), *layout, uri], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    [run] = mlflow_runs(db)
    assert run.info.status == "FINISHED", run.data.tags
    artifact = mlflow_client(db).download_artifacts(run.info.run_id, "mesh_hosts.json", str(tmp_path))
    where = json.loads(Path(artifact).read_text())
    assert where["dims"] == ["dp_replicate", "dp_shard"]
    grid = where["hosts"]  # grid[replica][shard]: the host of the rank at that position
    assert all(len({replica[shard] for replica in grid}) == 2 for shard in range(2))  # each shard's replicas: 2 hosts
    assert all(len(set(replica)) == 1 for replica in grid)  # each replica's shards: 1 host


def test_a_sweep_runs_its_points_as_ray_jobs_at_once(one_node_sweep):
    """Two points, each a job of one node's two ranks: both run at the same time (one per worker)."""
    done, db = one_node_sweep
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    runs = mlflow_runs(db)
    assert len(runs) == 2 and all(run.info.status == "FINISHED" for run in runs), [r.info for r in runs]
    first, second = sorted(runs, key=lambda run: run.info.start_time)
    assert second.info.start_time < first.info.end_time, "the points ran one after the other"
    assert {run.data.tags["hosts"] for run in runs} == set(WORKERS)
    assert len({run.data.tags["ray_job_id"] for run in runs}) == 2


def test_a_job_whose_node_died_starts_again_and_resumes_in_the_same_run(cluster, tmp_path, store):
    """With checkpoints: the node dies after a checkpoint, the driver starts the job again (Ray places it
    once the node is back), the ranks resume from the checkpoint and finish in the same MLflow run."""
    uri, db = store
    resumable = ["checkpoint.enable=true", "checkpoint.interval=20", "training.steps=150", "launcher.max_retries=1"]
    job = _start([*JOB, *_on_ray(cluster), *TWO_NODES, *resumable, "launcher.heartbeat_timeout_s=20", uri], tmp_path)
    try:
        placed = wait_for_output(tmp_path, r"ranks placed by Ray: rank 0 on ([\d.]+), rank 1 on ([\d.]+)")
        wait_for_output(tmp_path, r"^step    45/")
        dead = cluster.node_of(placed.group(2))
        cluster.kill(dead)
        wait_for_output(tmp_path, r"the job starts again to resume from its last checkpoint \(attempt 2 of 2", 120)
        cluster.revive(dead)
        assert job.wait(timeout=240) == 0, (tmp_path / "out.txt").read_text()[-3000:]
    finally:
        job.kill()
        if cluster.alive_workers() != set(WORKERS):
            cluster.revive(dead)
    [run] = mlflow_runs(db)
    assert run.info.status == "FINISHED", run.data.tags
    resumed = re.search(r"^resumed from \S+/step-(\d+)$", (tmp_path / "out.txt").read_text(), re.M)
    assert 40 <= int(resumed.group(1)) < 150, resumed.group(0)
    steps = [step for step, _ in steps_and_losses(mlflow_client(db), run.info.run_id)]
    assert steps[-1] == 150 and set(range(1, 151)) <= set(steps), steps


def test_a_job_stopped_from_outside_ends_killed_and_leaves_no_rank(cluster, tmp_path, store):
    uri, db = store
    job = _start([*JOB, *_on_ray(cluster), *TWO_NODES, "training.steps=5000", uri], tmp_path)
    try:
        submission = wait_for_output(tmp_path, r"^Ray job (titan_exp-\S+) submitted").group(1)
        wait_for_output(tmp_path, r"^step     3/")
        stopped = cluster.ray("job", "stop", submission)
        assert stopped.returncode == 0, stopped.stderr
        assert job.wait(timeout=120) == 1, (tmp_path / "out.txt").read_text()[-3000:]
    finally:
        job.kill()
    [run] = mlflow_runs(db)
    assert run.info.status == "KILLED", run.data.tags
    assert "stopped from outside" in run.data.tags["failure_reason"]
    assert not any(cluster.rank_processes(node) for node in WORKERS)


def test_an_sqlite_store_a_node_cannot_see_is_refused_in_one_line(cluster, tmp_path, migrated_store):
    uri, db = store_in(cluster.private, migrated_store)
    done = run_cli([*JOB, *_on_ray(cluster), *TWO_NODES, uri], tmp_path)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert f"tracking.uri={uri.split('=', 1)[1]}: an SQLite store must be on a disk every node sees" in line, line
    assert "mlflow server" in line and "does not see" in line
    assert not mlflow_runs(db)


def test_a_dead_worker_fails_the_run_naming_its_node_and_leaves_no_rank(cluster, tmp_path, store):
    """Last of the module: the dead worker stays dead (the cluster is removed after it)."""
    uri, db = store
    timeout_s = 20
    job = _start(
        [*JOB, *_on_ray(cluster), *TWO_NODES, "training.steps=5000", f"launcher.heartbeat_timeout_s={timeout_s}", uri],
        tmp_path,
    )
    try:
        placed = wait_for_output(tmp_path, r"ranks placed by Ray: rank 0 on ([\d.]+), rank 1 on ([\d.]+)")
        wait_for_output(tmp_path, r"^step     3/")
        dead, alive = cluster.node_of(placed.group(2)), cluster.node_of(placed.group(1))
        cluster.kill(dead)
        killed = time.monotonic()
        assert job.wait(timeout=180) == 1, (tmp_path / "out.txt").read_text()[-3000:]
        took = time.monotonic() - killed
    finally:
        job.kill()
    [run] = mlflow_runs(db)
    assert run.info.status == "FAILED"
    reason = run.data.tags["failure_reason"]
    assert "rank 1 failed: lost its node " + placed.group(2) in reason, reason
    # Named once Ray's health checks declare the node dead (within the heartbeat limit), the other
    # rank then stopped (5 s after SIGINT at most, then SIGKILL) and the job ended.
    assert took < timeout_s + 30, took
    assert not cluster.rank_processes(alive)


def _start(args: list[str], tmp_path: Path) -> subprocess.Popen:
    """`python -m titan_exp ARGS` in the background, its output in tmp_path/out.txt."""
    command = [sys.executable, "-m", "titan_exp", f"hydra.run.dir={tmp_path}/run", *args]
    out = open(tmp_path / "out.txt", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]

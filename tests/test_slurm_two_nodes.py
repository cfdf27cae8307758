"""Two Slurm nodes for real, on one machine (tests/slurm/two_node_cluster.sh): hosts tn1 and tn2 are
network namespaces with hostnames of their own, a slurmd in each. Jobs that span both: launcher=slurm
jobs, srun and torchrun started by hand, HSDP with its replicas on different hosts, two jobs at once,
a sweep over the node count, and a node that dies mid-run. Ranks talk over gloo between the
namespaces; the MLflow store is a file both see, as a shared file system would be."""

import csv
import getpass
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from launchers.rendezvous import expand_nodelist, job_port

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
from slurm_cluster import TwoNodeCluster

pytestmark = pytest.mark.slurm

# Deterministic FSDP over CPU ranks, every step's loss logged; the layout comes from the test.
JOB = [
    "debug=deterministic", "data=synthetic", "training.seq_len=64", "training.local_batch_size=2",
    "metrics.log_freq=1", "launcher.device=cpu", "parallelism=fsdp", "training.steps=6", *SMALL_MODEL,
]  # fmt: skip
ON_SLURM = ["launcher=slurm", "launcher.timeout_min=10"]
TWO_NODES = [*ON_SLURM, "launcher.nodes=2", "launcher.nproc_per_node=1"]
RTOL = 1e-4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[TwoNodeCluster]:
    started = TwoNodeCluster.start(tmp_path_factory.mktemp("two_nodes"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(autouse=True)
def no_job_outlives_its_test(request):
    """Whatever a test asserted or failed on, its jobs are cancelled after it (the next test finds
    both nodes idle)."""
    yield
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").slurm("scancel", f"--user={getpass.getuser()}")


@pytest.fixture(scope="module")
def one_node_curve(cluster, tmp_path_factory, migrated_store) -> list[float]:
    """The loss curve of the same layout (FSDP over 2 ranks) as one node's 2 ranks."""
    folder = tmp_path_factory.mktemp("one_node")
    uri, db = store_in(folder, migrated_store)
    done = run_cli([*JOB, *ON_SLURM, "launcher.nproc_per_node=2", uri], folder, env=cluster.env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    [run] = mlflow_runs(db)
    assert run.data.tags["hosts"] in ("tn1", "tn2")
    return loss_curve(db, run.info.run_id)


def _finished_on_both_nodes(db: Path, launcher: str) -> object:
    """The job's one run: FINISHED, its ranks on tn1 then tn2 (rank 0 on the first node)."""
    [run] = mlflow_runs(db)
    assert run.info.status == "FINISHED", run.data.tags
    assert run.data.tags["launcher"] == launcher and run.data.tags["hosts"] == "tn1,tn2", run.data.tags
    return run


def test_two_node_cluster_stops_without_a_trace_and_a_failed_start_cleans_up(tmp_path):
    """A cluster of its own: its hosts answer as themselves; stopped, no namespace, link or daemon
    of it is left. A start that fails halfway (a slurm.conf port slurmctld refuses) removes what it
    had made: the network and munged."""
    before = _namespaces_and_links()
    cluster = TwoNodeCluster.start(tmp_path / "good")
    try:
        assert cluster.node_states() == {"tn1": "idle", "tn2": "idle"}
        seen = subprocess.run(
            [*cluster.on("tn2"), "sh", "-c", "hostname; getent hosts tn1"], capture_output=True, text=True, timeout=30
        )
        assert seen.stdout.split()[0] == "tn2" and seen.stdout.split()[2] == "tn1", seen
        assert _namespaces_and_links() != before
    finally:
        cluster.stop()
    assert _namespaces_and_links() == before and not processes_naming(tmp_path / "good")

    failing = TwoNodeCluster(tmp_path / "bad", {**cluster.ports, "SLURMD_PORT": "notaport"})
    assert failing.script("start", check=False).returncode != 0
    assert _namespaces_and_links() == before and not processes_naming(tmp_path / "bad")


def _namespaces_and_links() -> tuple[str, ...]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split("\n")
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return tuple(
        sorted([name.split()[0] for name in names if name.strip()] + re.findall(r"^\d+: ([^:@]+)", links, re.M))
    )


def test_two_node_lists_expand_as_scontrol_does(cluster):
    forms = ["tn[1-2]", "node[01-04,07],gpu1", "gpu-[009-011]", "node[098-101]", "a[1-2]-b[3-4]", "tn2,tn1"]
    for form in forms:
        assert expand_nodelist(form) == cluster.slurm("scontrol", "show", "hostnames", form).stdout.split(), form


def test_two_node_fsdp_job_trains_across_hosts_as_on_one_node(cluster, one_node_curve, tmp_path, store):
    uri, db = store
    done = run_cli([*JOB, *TWO_NODES, uri], tmp_path, env=cluster.env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "hosts: tn1 (ranks 0), tn2 (ranks 1)" in done.stdout
    run = _finished_on_both_nodes(db, "slurm")
    job_id = re.search(r"^Slurm job (\d+) submitted: 2 ranks", done.stdout, re.M).group(1)
    assert run.data.tags["slurm_job_id"] == job_id
    torch.testing.assert_close(loss_curve(db, run.info.run_id), one_node_curve, rtol=RTOL, atol=0)


@pytest.mark.slow
def test_two_node_ranks_started_by_srun_by_hand_join_though_one_node_starts_late(
    cluster, one_node_curve, tmp_path, store
):
    """srun starts the ranks (no titan_exp launcher), tn2's 8 s after tn1's: rank 0 waits for it."""
    uri, db = store
    late = 'if [ "$SLURM_NODEID" = 1 ]; then sleep 8; fi; exec "$@"'
    srun = ["srun", "--nodes=2", "--ntasks-per-node=1", "--immediate=60", "--time=10", "bash", "-c", late, "--"]
    done = run_cli([*JOB, uri], tmp_path, launcher=[*srun, sys.executable, "-m"], env=cluster.env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    run = _finished_on_both_nodes(db, "srun")
    assert run.data.tags["world_size"] == "2" and run.data.tags["slurm_job_id"].isdigit()
    torch.testing.assert_close(loss_curve(db, run.info.run_id), one_node_curve, rtol=RTOL, atol=0)


@pytest.mark.slow
def test_two_node_torchrun_on_each_node_with_a_static_rendezvous(cluster, one_node_curve, tmp_path, store):
    """As users do without Slurm: torchrun on each host, the first host's name and a port agreed in
    advance; the second host starts 8 s after the first."""
    uri, db = store
    args = [f"hydra.run.dir={tmp_path}/run", *JOB, uri]
    first, second = (
        [*cluster.on(node), sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}",
         "--master_addr=tn1", "--master_port=29517", "--nproc_per_node=1", "-m", "titan_exp", *args]
        for rank, node in enumerate(("tn1", "tn2"))
    )  # fmt: skip
    with open(tmp_path / "tn1.txt", "w") as out:
        head = subprocess.Popen(first, cwd=REPO, env=cluster.env, stdout=out, stderr=subprocess.STDOUT)
        try:
            time.sleep(8)
            tail = subprocess.run(second, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=300)
            assert head.wait(timeout=120) == 0, (tmp_path / "tn1.txt").read_text()[-3000:]
        finally:
            head.kill()
    assert tail.returncode == 0, tail.stdout[-2000:] + tail.stderr[-3000:]
    run = _finished_on_both_nodes(db, "torchrun")
    torch.testing.assert_close(loss_curve(db, run.info.run_id), one_node_curve, rtol=RTOL, atol=0)


@pytest.mark.slow
def test_two_node_hsdp_replicates_across_hosts_and_shards_within_each(cluster, tmp_path, store):
    uri, db = store
    layout = ["parallelism=hsdp", "launcher.nproc_per_node=2"]
    done = run_cli([*JOB, *TWO_NODES, *layout, uri], tmp_path, env=cluster.env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    run = _finished_on_both_nodes(db, "slurm")
    artifact = mlflow_client(db).download_artifacts(run.info.run_id, "mesh_hosts.json", str(tmp_path))
    where = json.loads(Path(artifact).read_text())
    assert where["dims"] == ["dp_replicate", "dp_shard"]
    grid = where["hosts"]  # grid[replica][shard]: the host of the rank at that position
    assert all(len({replica[shard] for replica in grid}) == 2 for shard in range(2))  # each shard's replicas: 2 hosts
    assert all(len(set(replica)) == 1 for replica in grid)  # each replica's shards: 1 host
    assert "hosts: tn1 (ranks 0-1), tn2 (ranks 2-3); dp_replicate across hosts, dp_shard within one" in done.stdout


@pytest.mark.slow
def test_two_node_jobs_at_once_each_find_a_free_port_on_the_first_node(cluster, tmp_path, store):
    """The next job ids' derived ports are held on tn1 while two jobs run at once: each job's batch
    script finds another port free there, and the two do not meet on the same one. (Each
    submission takes two ids: `sbatch --test-only` takes one.)"""
    uri, db = store
    probe = cluster.slurm("sbatch", "--parsable", "--hold", "--wrap=true").stdout.strip()
    cluster.slurm("scancel", probe)
    next_ids = [int(probe) + i for i in range(1, 5)]
    hold = "import socket, sys, time; s = [socket.create_server(('', int(p))) for p in sys.argv[1:]]; print('held')"
    hold += "; sys.stdout.flush(); time.sleep(600)"
    holder = subprocess.Popen(
        [*cluster.on("tn1"), sys.executable, "-c", hold, *(str(job_port(i)) for i in next_ids)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        jobs = [
            subprocess.Popen(
                [sys.executable, "-m", "titan_exp", f"hydra.run.dir={tmp_path}/job{i}", *JOB, *TWO_NODES, uri],
                cwd=REPO,
                env=cluster.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for i in range(2)
        ]
        outputs = [job.communicate(timeout=300)[0] for job in jobs]
    finally:
        holder.kill()
    assert [job.returncode for job in jobs] == [0, 0], "\n".join(out[-2000:] for out in outputs)
    runs = mlflow_runs(db)
    assert len(runs) == 2 and {int(run.data.tags["slurm_job_id"]) for run in runs} <= set(next_ids)
    assert all(run.info.status == "FINISHED" and run.data.tags["hosts"] == "tn1,tn2" for run in runs)


@pytest.mark.slow
def test_two_node_sweep_over_the_node_count_gives_a_scaling_column(cluster, tmp_path, store):
    uri, db = store
    done = run_cli(
        [*JOB, *ON_SLURM, "launcher.nproc_per_node=1", "launcher.nodes=1,2", uri],
        tmp_path, flags=("-m",), env=cluster.env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = mlflow_runs(db)
    assert sorted(run.data.tags["hosts"] for run in runs) == ["tn1", "tn1,tn2"]
    assert all(run.info.status == "FINISHED" for run in runs)
    [parent] = mlflow_runs(db, sweeps=True)
    assert {run.data.tags["mlflow.parentRunId"] for run in runs} == {parent.info.run_id}
    with open(tmp_path / "multirun" / "compare" / "strategy_table.csv") as table:
        rows = list(csv.DictReader(table))
    efficiency = {row["world_size"]: row["scaling_efficiency"] for row in rows}  # one rank per node
    assert efficiency["1"] == "1.0" and 0 < float(efficiency["2"]), rows
    assert (tmp_path / "multirun" / "compare" / "scaling.png").exists()


def _start_job(args: list[str], tmp_path: Path, env: dict) -> subprocess.Popen:
    """`python -m titan_exp ARGS` in the background, its output in tmp_path/out.txt."""
    command = [sys.executable, "-m", "titan_exp", f"hydra.run.dir={tmp_path}/run", *args]
    out = open(tmp_path / "out.txt", "w")
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def _back_up(cluster: TwoNodeCluster, node: str) -> None:
    """The node back in service if it died, as after a reboot: Slurm returns it once its slurmd
    registers again."""
    if any(line.split(" ", 1)[-1].startswith("slurmd ") for line in cluster.script("ps", node).stdout.splitlines()):
        return
    cluster.revive(node)
    deadline = time.monotonic() + 60
    while cluster.node_states().get(node) != "idle":
        assert time.monotonic() < deadline, cluster.node_states()
        time.sleep(0.5)


@pytest.mark.slow
def test_two_node_job_whose_node_dies_ends_failed_naming_it_and_leaves_nothing(cluster, tmp_path, store):
    """tn2 dies mid-run (no word reaches tn1: its link goes down first) while rank 0 waits for it in a
    collective: within launcher.heartbeat_timeout_s the job is cancelled and its run ends FAILED,
    naming tn2; rank 0, which cannot act on SIGTERM inside the collective, is gone from tn1 within
    Slurm's KillWait (30 s)."""
    uri, db = store
    heartbeat_s = 20
    args = [*JOB, *TWO_NODES, "training.steps=50000", f"launcher.heartbeat_timeout_s={heartbeat_s}", uri]
    job = _start_job(args, tmp_path, cluster.env)
    job_id = wait_for_output(tmp_path, r"^Slurm job (\d+) submitted").group(1)
    try:
        wait_for_output(tmp_path, r"^step    20/")
        died = time.monotonic()
        cluster.kill("tn2")
        assert job.wait(timeout=120) == 1, (tmp_path / "out.txt").read_text()[-3000:]
        ended_after = time.monotonic() - died
        deadline = time.monotonic() + 45
        while left := [line for line in cluster.processes("tn1") if "submitit" in line or "titan_exp" in line]:
            assert time.monotonic() < deadline, left
            time.sleep(1)
        print(f"node died; job ended {ended_after:.1f} s later, tn1 empty {time.monotonic() - died:.1f} s later")
    finally:  # whatever failed, the next test finds both nodes up and no job of this one
        cluster.slurm("scancel", job_id)
        job.kill()
        _back_up(cluster, "tn2")
    assert heartbeat_s <= ended_after < heartbeat_s + 15
    [run] = mlflow_runs(db)
    assert run.info.status == "FAILED", run.data.tags
    reason = run.data.tags["failure_reason"]
    assert "rank 1 failed: stopped answering" in reason and "from tn2" in reason and f"job {job_id} cancelled" in reason


@pytest.mark.slow
def test_two_node_job_whose_node_dies_requeues_and_resumes_in_the_same_run(cluster, tmp_path, store):
    """With checkpoints, a lost node gets the job requeued instead: Slurm holds it pending while it
    has one node of the two it needs; once tn2 is back the job resumes from its last checkpoint in
    the same MLflow run, each step once in its curve, the same loss curve as a job that lost nothing."""
    uri, db = store
    steps = ["training.steps=150", "launcher.heartbeat_timeout_s=20"]
    checkpoints = ["checkpoint=periodic", f"checkpoint.folder={tmp_path}/ckpt", "checkpoint.interval=10"]
    reference = run_cli([*JOB, *TWO_NODES, *steps, uri], tmp_path / "reference", env=cluster.env)
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-3000:]
    job = _start_job([*JOB, *TWO_NODES, *steps, *checkpoints, uri], tmp_path, cluster.env)
    job_id = wait_for_output(tmp_path, r"^Slurm job (\d+) submitted").group(1)
    try:
        wait_for_output(tmp_path, r"^step    25/")
        cluster.kill("tn2")
        wait_for_output(tmp_path, rf"stopped answering: .* from tn2 .*; job {job_id} requeued to resume", timeout=60)
        deadline = time.monotonic() + 120  # tn2 is DOWN once slurmctld has not heard from it for SlurmdTimeout
        while "DOWN" not in (waiting := cluster.slurm("squeue", "-h", "-j", job_id, "-o", "%T %r").stdout):
            assert time.monotonic() < deadline, waiting
            time.sleep(1)
        assert waiting.startswith("PENDING"), waiting  # one node of two up: it waits for the other
        _back_up(cluster, "tn2")
        assert job.wait(timeout=300) == 0, (tmp_path / "out.txt").read_text()[-3000:]
    finally:
        cluster.slurm("scancel", job_id)
        job.kill()
        _back_up(cluster, "tn2")
    out = (tmp_path / "out.txt").read_text()
    # Killed after step 25: the last save before the ranks stopped (step 30 where tn2 took a while to die).
    assert re.search(rf"^resumed from {tmp_path}/ckpt/step-(10|20|30|40)$", out, re.M), out[-3000:]
    reference_run, run = mlflow_runs(db)
    assert run.info.status == "FINISHED" and run.data.tags["slurm_job_id"] == job_id
    # Steps after the checkpoint ran twice; the curve counts each once, with the resumed job's value
    # (as a resumed job's run always does: test_parity's resume test).
    steps_logged = {m.step for m in mlflow_client(db).get_metric_history(run.info.run_id, "loss/global_avg")}
    assert steps_logged == set(range(1, 151)) and len(loss_curve(db, run.info.run_id)) == 150
    torch.testing.assert_close(
        loss_curve(db, run.info.run_id), loss_curve(db, reference_run.info.run_id), rtol=RTOL, atol=0
    )

"""Slurm for real: a one-node cluster (Debian's slurm-wlm + munge) that this module starts and
stops. Ranks started by srun, and jobs that titan_exp submits itself (launcher=slurm): a job
requeued after Slurm's warning signal that resumes in the same MLflow run and trains the same loss
curve as a local run, and jobs stopped from outside whose runs end with Slurm's word. The default
suite keeps one job launcher=slurm submits, follows and stops on the one-node cluster; the rest are
marked `slurm`."""

import getpass
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from launchers.rendezvous import free_port

from conftest import REPO, SMALL_MODEL, loss_curve, mlflow_client, mlflow_runs, run_cli, wait_for_output


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


@pytest.fixture(autouse=True)
def no_job_outlives_its_test(request):
    """Whatever a test asserted or failed on, the jobs it submitted are cancelled after it: the next
    test finds the cluster idle (a job left running would hold its cores and skew that test)."""
    yield
    if "slurm_env" in request.fixturenames:
        env = request.getfixturevalue("slurm_env")
        subprocess.run(["scancel", f"--user={getpass.getuser()}"], env=env, capture_output=True, timeout=60)


@pytest.mark.slurm
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
        *SMALL_MODEL,
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


# Deterministic FSDP over 2 CPU ranks; every step's loss is logged.
JOB = [
    "debug=deterministic", "data=synthetic", "training.seq_len=64", "training.local_batch_size=2",
    "metrics.log_freq=1", "launcher.device=cpu", "launcher.nproc_per_node=2", "parallelism=fsdp", *SMALL_MODEL,
]  # fmt: skip
SLURM = ["launcher=slurm", "launcher.timeout_min=10"]
RTOL = 1e-4


def _start(args: list[str], tmp_path, env: dict) -> subprocess.Popen:
    """`python -m titan_exp ARGS` in the background, its output in tmp_path/out.txt."""
    command = [sys.executable, "-m", "titan_exp", f"hydra.run.dir={tmp_path}/run", *args]
    out = open(tmp_path / "out.txt", "w")
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's job has it
    )  # fmt: skip


@pytest.mark.slurm
def test_warned_job_saves_requeues_and_resumes_in_the_same_run(slurm_env, tmp_path, store):
    uri, db = store
    steps = [
        "training.steps=20",
        "checkpoint=periodic",
        f"checkpoint.folder={tmp_path}/ckpt",
        "checkpoint.interval=100",
    ]
    reference = run_cli([*JOB, *steps[:1], uri], tmp_path / "reference", env=slurm_env)
    assert reference.returncode == 0, reference.stderr[-3000:]
    job = _start([*JOB, *SLURM, *steps, uri], tmp_path, slurm_env)
    submitted = wait_for_output(tmp_path, r"^Slurm job (\d+) submitted: 2 ranks, logs (\S+)")
    job_id = submitted.group(1)
    wait_for_output(tmp_path, r"^step     5/")  # rank 0's lines streamed to the submitting terminal
    # What Slurm sends signal_delay_s ahead of the time limit, or on preemption.
    subprocess.run(["scancel", "--signal=USR2", job_id], env=slurm_env, check=True)
    assert job.wait(timeout=300) == 0, (tmp_path / "out.txt").read_text()[-3000:]
    out = (tmp_path / "out.txt").read_text()
    stopped_at = int(re.search(r"ranks stopped after step (\d+); requeued", out).group(1))
    assert 5 <= stopped_at < 20 and f"resumed from {tmp_path}/ckpt/step-{stopped_at}" in out
    reference_run, run = mlflow_runs(db)
    assert run.info.status == "FINISHED" and run.data.tags["slurm_job_id"] == job_id
    assert run.data.tags["launcher"] == "slurm"
    assert all(os.path.exists(submitted.group(2).replace("<rank>", str(rank))) for rank in (0, 1))
    steps_logged = [m.step for m in mlflow_client(db).get_metric_history(run.info.run_id, "loss/global_avg")]
    assert sorted(steps_logged) == list(range(1, 21))  # every step once, across both runs of the job
    torch.testing.assert_close(
        loss_curve(db, run.info.run_id), loss_curve(db, reference_run.info.run_id), rtol=RTOL, atol=0
    )


@pytest.mark.parametrize(
    "scancel",
    [
        [],  # SIGTERM to every task: rank 0 records KILLED before Slurm's KillWait runs out
        ["--signal=KILL"],  # no word from rank 0: the submitting process closes the run
    ],
    ids=["scancel", "scancel_signal_kill"],
)
@pytest.mark.slurm
def test_job_stopped_from_outside_never_stays_running(slurm_env, tmp_path, store, scancel):
    uri, db = store
    job = _start([*JOB, *SLURM, "training.steps=5000", uri], tmp_path, slurm_env)
    job_id = wait_for_output(tmp_path, r"^Slurm job (\d+) submitted").group(1)
    wait_for_output(tmp_path, r"^step     3/")
    subprocess.run(["scancel", *scancel, job_id], env=slurm_env, check=True)
    assert job.wait(timeout=180) == 1, (tmp_path / "out.txt").read_text()[-3000:]
    [run] = mlflow_runs(db)
    # Slurm's final state of the job is the reason.
    assert run.info.status == "KILLED", run.data.tags
    assert f"Slurm job {job_id} CANCELLED" in run.data.tags["failure_reason"], run.data.tags
    assert (
        subprocess.run(["squeue", "-h", "-j", job_id], env=slurm_env, capture_output=True, text=True).stdout.strip()
        == ""
    )


@pytest.mark.slurm
@pytest.mark.slow
def test_time_limit_requeues_and_resumes_until_done(slurm_env, tmp_path, store):
    """A real time limit: 2 minutes, with Slurm's warning 30 s ahead (it may come up to a minute
    earlier still), so a run of the job trains for at most ~85 s (less its start). One rank on one
    core, its steps compute-bound (0.19-0.3 s each here, not a tiny batch's overhead, which changes
    with the code): 600 steps are 115-180 s of training, more than one run of the job can do
    however fast the machine is (500 had been: 95 s once)."""
    uri, db = store
    limits = ["launcher=slurm", "launcher.timeout_min=2", "launcher.signal_delay_s=30"]
    checkpoints = ["checkpoint=periodic", f"checkpoint.folder={tmp_path}/ckpt", "checkpoint.interval=1000"]
    one_rank = ["launcher.nproc_per_node=1", "launcher.cpu_threads_per_rank=1", "parallelism=single"]
    compute_bound = ["training.seq_len=512", "training.local_batch_size=8", "training.steps=600", "metrics.log_freq=10"]
    job = _start([*JOB, *one_rank, *limits, *checkpoints, *compute_bound, uri], tmp_path, slurm_env)
    assert job.wait(timeout=1200) == 0, (tmp_path / "out.txt").read_text()[-3000:]
    out = (tmp_path / "out.txt").read_text()
    requeues = re.findall(r"TIMEOUT: Slurm sent SIGUSR2 and the ranks stopped after step (\d+); requeued", out)
    assert 1 <= len(requeues) <= 8, out[-3000:]  # each run trains 25 s or more
    [run] = mlflow_runs(db)
    assert run.info.status == "FINISHED"
    steps = [m.step for m in mlflow_client(db).get_metric_history(run.info.run_id, "loss/global_avg")]
    assert sorted(steps) == [1, *range(10, 601, 10)]  # every log step once, across the job's runs


@pytest.mark.slurm
def test_sweep_submits_a_job_per_point_and_goes_on_past_a_failing_one(slurm_env, tmp_path, store):
    uri, db = store
    seed = tmp_path / "seed"
    seed_job = ["parallelism=single", "launcher.nproc_per_node=1", "checkpoint.create_seed_checkpoint=true"]
    created = run_cli(
        [*JOB, *seed_job, f"checkpoint.folder={seed}", "tracking=none"], tmp_path / "create", env=slurm_env
    )
    assert created.returncode == 0, created.stderr[-3000:]
    corrupt = tmp_path / "corrupt" / "step-0"  # passes the config check (the seed's model), fails when loaded
    corrupt.mkdir(parents=True)
    (corrupt / ".metadata").write_bytes(b"not a checkpoint")
    (corrupt / "model.json").write_bytes((seed / "step-0" / "model.json").read_bytes())
    starts = f"checkpoint.initial_load_path=null,{seed}/step-0,{corrupt}"
    result = run_cli(
        [*JOB, *SLURM, "training.steps=4", uri, starts], tmp_path, flags=("-m",), env=slurm_env, timeout=600
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    failed_point = re.search(rf"^\[2\] checkpoint.initial_load_path={corrupt}: failed \((.*)\)$", result.stdout, re.M)
    assert failed_point and "is not a readable checkpoint" in failed_point.group(1), result.stdout
    assert "1 sweep point(s) failed" in result.stderr
    runs = mlflow_runs(db)
    assert sorted(run.info.status for run in runs) == ["FAILED", "FINISHED", "FINISHED"]
    job_ids = {run.data.tags["slurm_job_id"] for run in runs}
    assert len(job_ids) == 3 and all(job_id.isdigit() for job_id in job_ids)  # one Slurm job per point
    [parent] = mlflow_runs(db, sweeps=True)
    assert {run.data.tags["mlflow.parentRunId"] for run in runs} == {parent.info.run_id}
    assert parent.info.status == "FAILED" and parent.data.tags["failure_reason"] == "1 sweep point(s) failed"
    table = (tmp_path / "multirun" / "compare" / "strategy_table.csv").read_text()
    assert table.count("FINISHED") == 2 and table.count("FAILED") == 1


@pytest.mark.slurm
def test_ctrl_c_while_waiting_cancels_the_job_and_its_run_ends_killed(slurm_env, tmp_path, store):
    uri, db = store
    job = _start([*JOB, *SLURM, "training.steps=5000", uri], tmp_path, slurm_env)
    job_id = wait_for_output(tmp_path, r"^Slurm job (\d+) submitted").group(1)
    wait_for_output(tmp_path, r"^step     3/")
    job.send_signal(signal.SIGINT)  # the submitting process only, as from a terminal it would be the group
    assert job.wait(timeout=180) != 0
    [run] = mlflow_runs(db)
    assert run.info.status == "KILLED", run.data.tags
    assert (
        subprocess.run(["squeue", "-h", "-j", job_id], env=slurm_env, capture_output=True, text=True).stdout.strip()
        == ""
    )


@pytest.mark.slurm
def test_without_waiting_the_job_runs_on_after_the_submitter_returns(slurm_env, tmp_path, store):
    uri, db = store
    result = run_cli([*JOB, *SLURM, "launcher.wait=false", "training.steps=4", uri], tmp_path, env=slurm_env)
    assert result.returncode == 0, result.stderr[-3000:]
    job_id = re.search(r"^Slurm job (\d+) submitted", result.stdout, re.M).group(1)
    assert "step" not in result.stdout  # nothing streamed: it returned at once
    deadline = time.monotonic() + 180
    while not (runs := mlflow_runs(db)) or runs[0].info.status == "RUNNING":
        assert time.monotonic() < deadline, "the job never finished its run"
        time.sleep(1)
    assert runs[0].info.status == "FINISHED" and runs[0].data.tags["slurm_job_id"] == job_id


def test_warned_job_without_checkpoints_ends_killed_with_timeout(slurm_env, tmp_path, store):
    uri, db = store
    job = _start([*JOB, *SLURM, "training.steps=5000", uri], tmp_path, slurm_env)
    job_id = wait_for_output(tmp_path, r"^Slurm job (\d+) submitted").group(1)
    wait_for_output(tmp_path, r"^step     3/")
    subprocess.run(["scancel", "--signal=USR2", job_id], env=slurm_env, check=True)
    assert job.wait(timeout=180) == 1, (tmp_path / "out.txt").read_text()[-3000:]
    [run] = mlflow_runs(db)
    assert run.info.status == "KILLED", run.data.tags
    reason = run.data.tags["failure_reason"]
    assert "TIMEOUT" in reason and "checkpoint.enable=false" in reason, reason
    assert "requeued" not in (tmp_path / "out.txt").read_text()


@pytest.mark.parametrize(
    "option,said",
    [
        ("launcher.partition=nope", "invalid partition"),
        ("launcher.mem_gb=100000", "node configuration is not available"),
        ("+launcher.additional_parameters.bogus=1", "unrecognized option"),
    ],
    ids=["unknown_partition", "more_memory_than_a_node", "unknown_option"],
)
@pytest.mark.slurm
def test_a_job_slurm_would_refuse_is_refused_in_one_line_before_anything_is_written(
    slurm_env, tmp_path, new_store, option, said
):
    uri, db = new_store
    steps = ["training.steps=2", "lr_scheduler.warmup_steps=1"]
    result = run_cli([*JOB, *SLURM, option, *steps, uri], tmp_path, env=slurm_env)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Slurm would refuse this job" in lines[0] and said in lines[0].lower(), result.stderr
    assert not db.exists() and not (tmp_path / "run" / "slurm").exists()


def _task_pid(job_id: str, rank: int) -> int:
    """The pid of a task of a Slurm job on this machine: the Python process of the job's step whose
    environment names the rank (not srun, not rank 0's MLflow writer, a child of its task)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(v.split("=", 1) for v in (proc / "environ").read_bytes().decode().split("\0") if "=" in v)
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            parent_name = Path(f"/proc/{parent}/comm").read_text().strip()
        except (OSError, IndexError, ValueError):
            continue
        ours = env.get("SLURM_JOB_ID") == job_id and env.get("SLURM_PROCID") == str(rank) and "SLURM_STEP_ID" in env
        # The task itself is slurmstepd's child; its own children (a forked helper, one not yet
        # exec'd) carry the same command line and environment.
        if ours and b"submitit.core._submit" in command and b"srun" not in command[0] and parent_name == "slurmstepd":
            found.append(int(proc.name))
    assert len(found) == 1, f"rank {rank} of job {job_id}: tasks {found}"
    return found[0]


@pytest.mark.slurm
def test_a_stopped_task_is_named_by_its_heartbeat_and_the_job_cancelled(slurm_env, tmp_path, store):
    uri, db = store
    job = _start([*JOB, *SLURM, "training.steps=5000", "launcher.heartbeat_timeout_s=20", uri], tmp_path, slurm_env)
    job_id = wait_for_output(tmp_path, r"^Slurm job (\d+) submitted").group(1)
    try:
        wait_for_output(tmp_path, r"^step     3/")
        os.kill(_task_pid(job_id, 1), signal.SIGSTOP)
        assert job.wait(timeout=120) == 1, (tmp_path / "out.txt").read_text()[-3000:]
    finally:  # a failure here must not leave the job running past the cluster
        subprocess.run(["scancel", job_id], env=slurm_env)
        job.kill()
    [run] = mlflow_runs(db)
    assert run.info.status == "FAILED"
    assert "rank 1 failed: stopped answering: no heartbeat for" in run.data.tags["failure_reason"], run.data.tags
    assert (
        subprocess.run(["squeue", "-h", "-j", job_id], env=slurm_env, capture_output=True, text=True).stdout.strip()
        == ""
    )

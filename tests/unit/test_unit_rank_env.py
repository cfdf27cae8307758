"""launchers/env.py from hand-made environments: a rank's place under torchrun's variables or
srun's SLURM_* ones (compressed task counts and node lists), and the rendezvous derived from them.
monkeypatch restores the environment, including what export_slurm_environment writes."""

import os
import socket
from pathlib import Path

import pytest

from launchers.env import RankEnv, export, export_slurm_environment, external_launcher
from launchers.rendezvous import PORT_BASE, PORT_SPAN, PORT_TRIES, expand_nodelist, free_job_port, free_port, job_port

# Everything the code under test reads or writes.
VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
    "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
)  # fmt: skip


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch):
    """None of VARIABLES (nor any other SLURM_*) set; yields a setter. Each is set then deleted so
    that monkeypatch restores its original state whatever the test writes."""
    for key in {*VARIABLES, *(k for k in os.environ if k.startswith("SLURM_"))}:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)

    def set_env(**values: object) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, str(value))

    return set_env


def srun_step(env, *, procid: int, localid: int, nodeid: int, ntasks: int, per_node: str, **more: object) -> None:
    env(
        SLURM_JOB_ID=4242, SLURM_STEP_ID=0, SLURM_NTASKS=ntasks, SLURM_PROCID=procid,
        SLURM_LOCALID=localid, SLURM_NODEID=nodeid, SLURM_STEP_TASKS_PER_NODE=per_node, **more,
    )  # fmt: skip


def test_torchrun_variables(env) -> None:
    env(RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4)
    assert external_launcher() == "torchrun"
    assert RankEnv.from_environ() == RankEnv(rank=5, local_rank=1, world_size=8, local_world_size=4)


def test_local_world_defaults_to_the_world(env) -> None:
    env(RANK=2, WORLD_SIZE=3, LOCAL_RANK=2)
    assert RankEnv.from_environ() == RankEnv(rank=2, local_rank=2, world_size=3, local_world_size=3)


def test_an_elastic_run_id_alone_says_torchrun(env) -> None:
    env(TORCHELASTIC_RUN_ID="abc")
    assert external_launcher() == "torchrun"


def test_rank_without_world_size_is_not_a_launch(env) -> None:
    env(RANK=0)
    assert external_launcher() is None


@pytest.mark.parametrize(
    "per_node,node,expected",
    [("4(x3),2", 0, 4), ("4(x3),2", 2, 4), ("4(x3),2", 3, 2), ("2,3(x2),1", 2, 3), ("2,3(x2),1", 3, 1), ("16", 0, 16)],
)
def test_srun_compressed_tasks_per_node(env, per_node: str, node: int, expected: int) -> None:
    srun_step(env, procid=7, localid=1, nodeid=node, ntasks=14, per_node=per_node)
    assert external_launcher() == "srun"
    assert RankEnv.from_environ() == RankEnv(rank=7, local_rank=1, world_size=14, local_world_size=expected)


def test_a_node_beyond_the_counts_is_refused(env) -> None:
    srun_step(env, procid=0, localid=0, nodeid=4, ntasks=14, per_node="4(x3),2")
    with pytest.raises(ValueError, match="SLURM_NODEID=4"):
        RankEnv.from_environ()


def test_step_counts_win_over_the_jobs(env) -> None:
    """SLURM_STEP_TASKS_PER_NODE (this step's) before SLURM_TASKS_PER_NODE (the allocation's)."""
    srun_step(env, procid=0, localid=0, nodeid=0, ntasks=4, per_node="2(x2)", SLURM_TASKS_PER_NODE="8(x2)")
    assert RankEnv.from_environ().local_world_size == 2
    os.environ.pop("SLURM_STEP_TASKS_PER_NODE")
    assert RankEnv.from_environ().local_world_size == 8


def test_a_single_task_step_spawns_its_own_ranks(env) -> None:
    env(SLURM_JOB_ID=1, SLURM_STEP_ID=0, SLURM_NTASKS=1, SLURM_PROCID=0)
    assert external_launcher() is None
    assert RankEnv.from_environ() == RankEnv(0, 0, 1, 1)


def test_srun_exports_torch_variables_with_the_first_node_of_a_compressed_list(env) -> None:
    """node[003-005,010],gpu1: the first node is node003; the port derives from the job id alone."""
    srun_step(
        env, procid=9, localid=1, nodeid=2, ntasks=10, per_node="4(x2),2", SLURM_JOB_NODELIST="node[003-005,010],gpu1"
    )
    export_slurm_environment()
    exported = {key: os.environ[key] for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    assert exported == {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "10", "LOCAL_WORLD_SIZE": "2"}
    assert os.environ["MASTER_ADDR"] == "node003"
    assert os.environ["MASTER_PORT"] == str(job_port(4242))


def test_srun_export_keeps_what_is_already_set(env) -> None:
    srun_step(env, procid=1, localid=1, nodeid=0, ntasks=2, per_node="2", SLURM_JOB_NODELIST="gpu-[1-2]")
    env(MASTER_ADDR="10.1.2.3", MASTER_PORT=1234)
    export_slurm_environment()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], os.environ["RANK"]) == ("10.1.2.3", "1234", "1")


def test_export_round_trips(env) -> None:
    placed = RankEnv(rank=3, local_rank=0, world_size=4, local_world_size=1)
    export(placed, "127.0.0.1", 29501)
    assert external_launcher() == "torchrun" and RankEnv.from_environ() == placed
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("127.0.0.1", "29501")


def test_reading_changes_nothing(env) -> None:
    srun_step(env, procid=1, localid=1, nodeid=0, ntasks=2, per_node="2")
    before = dict(os.environ)
    RankEnv.from_environ()
    external_launcher()
    assert dict(os.environ) == before


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("tn[1-2]", ["tn1", "tn2"]),
        ("node[01-04,07],gpu1", ["node01", "node02", "node03", "node04", "node07", "gpu1"]),
        ("gpu-[009-011]", ["gpu-009", "gpu-010", "gpu-011"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
        ("tn2,tn1", ["tn2", "tn1"]),
    ],
)
def test_a_compressed_node_list_expands_in_slurms_order(nodelist, hosts) -> None:
    """The same lists as `scontrol show hostnames` (checked against it on the two-node cluster)."""
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[1-", "node[a-b]", "node[1-2", ",node1"])
def test_a_malformed_node_list_is_refused(nodelist) -> None:
    with pytest.raises(ValueError, match="not a Slurm node list"):
        expand_nodelist(nodelist)


def test_a_step_on_part_of_the_job_meets_on_its_own_first_node(env) -> None:
    srun_step(env, procid=0, localid=0, nodeid=0, ntasks=2, per_node="1(x2)", SLURM_JOB_NODELIST="tn[1-3]")
    env(SLURM_STEP_NODELIST="tn[2-3]")
    export_slurm_environment()
    assert os.environ["MASTER_ADDR"] == "tn2"


def test_a_taken_derived_port_gives_way_to_one_no_neighbouring_job_derives() -> None:
    job_id = next(i for i in range(1000, 2000) if free_job_port(i) == job_port(i))
    with socket.socket() as taken:
        taken.bind(("", job_port(job_id)))
        taken.listen()
        instead = free_job_port(job_id)
    assert instead == job_port(job_id + PORT_TRIES)  # the next job's port is job_port(job_id) + 1
    assert instead not in {job_port(job_id + d) for d in range(-PORT_TRIES + 1, PORT_TRIES)}
    assert free_job_port(job_id) == job_port(job_id)


def test_a_locally_chosen_port_lies_below_the_ephemeral_range_and_is_free() -> None:
    """The local launcher's rank 0 binds its port seconds after it is chosen: a port from the
    kernel's ephemeral range could meanwhile become another connection's local port (EADDRINUSE)."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(3)]
    assert len(set(ports)) == 3, ports  # successive calls (two servers of one test) differ
    for port in ports:
        assert PORT_BASE <= port < min(PORT_BASE + PORT_SPAN, ephemeral_low)
        with socket.socket() as server:
            server.bind(("", port))

"""launchers/env.py: a rank's place in the job, read from torchrun's or srun's variables."""

import os

import pytest

from launchers.env import RankEnv, export, export_slurm_environment, external_launcher
from launchers.rendezvous import job_port


def test_nothing_set_is_a_world_of_one(placement_env):
    assert external_launcher() is None
    assert RankEnv.from_environ() == RankEnv(rank=0, local_rank=0, world_size=1, local_world_size=1)


@pytest.mark.parametrize(
    "tasks_per_node,node,expected",
    [("8(x2)", 0, 8), ("8(x2)", 1, 8), ("8(x2),4", 2, 4), ("3,5", 1, 5), ("2", 0, 2)],
)
def test_every_task_of_an_srun_step_knows_its_place(placement_env, tasks_per_node, node, expected):
    placement_env(
        SLURM_STEP_ID=0,
        SLURM_NTASKS=20,
        SLURM_PROCID=9,
        SLURM_LOCALID=1,
        SLURM_NODEID=node,
        SLURM_STEP_TASKS_PER_NODE=tasks_per_node,
    )
    assert external_launcher() == "srun"
    assert RankEnv.from_environ() == RankEnv(rank=9, local_rank=1, world_size=20, local_world_size=expected)


def test_a_batch_script_or_single_task_step_spawns_its_own_ranks(placement_env):
    placement_env(SLURM_JOB_ID=5, SLURM_NTASKS=1, SLURM_STEP_ID=0)
    assert external_launcher() is None


def test_torchrun_variables_win_and_reading_changes_nothing(placement_env):
    placement_env(
        SLURM_STEP_ID=0, SLURM_NTASKS=4, SLURM_PROCID=3, SLURM_LOCALID=3, SLURM_NODEID=0, SLURM_STEP_TASKS_PER_NODE="4"
    )
    before = dict(os.environ)
    RankEnv.from_environ()
    assert dict(os.environ) == before
    export(RankEnv(rank=1, local_rank=1, world_size=2, local_world_size=2), "10.0.0.1", 29500)
    assert external_launcher() == "torchrun"
    assert RankEnv.from_environ() == RankEnv(rank=1, local_rank=1, world_size=2, local_world_size=2)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.1", "29500")


def test_two_nodes_of_eight_tasks_each_find_their_rank_and_one_rendezvous(placement_env):
    """What every task of a 2-node × 8-task Slurm job computes from the variables srun gives it."""
    seen = []
    for node in range(2):
        for local in range(8):
            rank = 8 * node + local
            os.environ.clear()  # placement_env restores the whole environment afterwards
            placement_env(
                SLURM_JOB_ID=31337, SLURM_JOB_NODELIST="gpu-[017-018]", SLURM_STEP_ID=0, SLURM_NTASKS=16,
                SLURM_STEP_TASKS_PER_NODE="8(x2)", SLURM_NODEID=node, SLURM_PROCID=rank, SLURM_LOCALID=local,
            )  # fmt: skip
            export_slurm_environment()
            keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            seen.append(tuple(os.environ[key] for key in keys))
    assert [s[:2] for s in seen] == [(str(8 * n + r), str(r)) for n in range(2) for r in range(8)]
    # One world, one rendezvous: the first node, a port every task derives from the job id alone.
    assert {s[2:] for s in seen} == {("16", "8", "gpu-017", str(job_port(31337)))}

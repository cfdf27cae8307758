"""The torch.distributed environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) of a rank,
whoever started it: torchrun, srun, or our own submitit launch."""

import os
import socket
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class RankEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def external_launcher() -> str | None:
    """'torchrun' or 'srun' when this process is already one rank of a job; None when we must spawn."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return "torchrun"
    # An srun step with several tasks; a batch script (or `srun -n1`) is one process that spawns.
    if "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "srun"
    return None


def export_from_slurm() -> None:
    """Translate srun's SLURM_* variables into torch.distributed's, keeping any already set."""
    nodes = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], capture_output=True, text=True, check=True
    ).stdout.split()
    os.environ.setdefault("MASTER_ADDR", nodes[0])
    # Derived from the job id so that every task of the job agrees without talking first.
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
    os.environ.setdefault("LOCAL_RANK", os.environ["SLURM_LOCALID"])
    os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])


def export(rank: int, local_rank: int, world_size: int, local_world_size: int, master_addr: str, master_port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )


def current() -> RankEnv:
    """This process's place in the job, from the environment (world of 1 when nothing is set)."""
    if external_launcher() == "srun":
        export_from_slurm()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return RankEnv(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=world,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

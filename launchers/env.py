"""The torch.distributed environment of a rank (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT), whoever started it: torchrun, srun, or our own launch."""

import os
import socket
import time
from dataclasses import dataclass

from launchers.rendezvous import first_node, job_port

_RENDEZVOUS_POLL_S = 0.01


@dataclass(frozen=True)
class RankEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> "RankEnv":
        """This process's place in the job, read (never changed) from torch.distributed's variables,
        else from srun's SLURM_* ones, else a world of one."""
        if "RANK" not in os.environ and external_launcher() == "srun":
            return cls(
                rank=int(os.environ["SLURM_PROCID"]),
                local_rank=int(os.environ["SLURM_LOCALID"]),
                world_size=int(os.environ["SLURM_NTASKS"]),
                local_world_size=_slurm_tasks_on_this_node(),
            )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=world,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        )

    def variables(self) -> dict[str, str]:
        """torch.distributed's variables for this place (MASTER_ADDR/PORT aside)."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }


def external_launcher() -> str | None:
    """'torchrun' or 'srun' when this process is already one rank of a job; None when we must spawn."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return "torchrun"
    # An srun step with several tasks; a batch script (or `srun -n1`) is one process that spawns.
    if "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return "srun"
    return None


def _slurm_tasks_on_this_node() -> int:
    """Tasks of this step on this node: srun's counts read like '8' or '8(x2),4'; this node's entry
    is the one its SLURM_NODEID falls in."""
    counts = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE") or "1"
    node = int(os.environ.get("SLURM_NODEID", "0"))
    for entry in counts.split(","):
        tasks, _, repeat = entry.partition("(x")
        repeats = int(repeat.rstrip(")")) if repeat else 1
        if node < repeats:
            return int(tasks)
        node -= repeats
    raise ValueError(f"SLURM_NODEID={os.environ.get('SLURM_NODEID')} is not among the nodes of {counts!r}")


def export_slurm_environment() -> None:
    """Set torch.distributed's variables from srun's, keeping any already set: the step's first
    node is the rendezvous address; the port is the one our batch script found free there
    (MASTER_PORT), else derived from the job id (launchers/rendezvous.py)."""
    env = RankEnv.from_environ()
    os.environ.setdefault("MASTER_ADDR", first_node())
    os.environ.setdefault("MASTER_PORT", str(job_port(int(os.environ["SLURM_JOB_ID"]))))
    for key, value in env.variables().items():
        os.environ.setdefault(key, value)


def export_external_environment(started_by: str) -> None:
    """A rank srun started gets torch.distributed's variables from srun's; torchrun sets them itself."""
    if started_by == "srun":
        export_slurm_environment()


def export(env: RankEnv, master_addr: str, master_port: int) -> None:
    """Set this process's torch.distributed variables."""
    os.environ.update(env.variables(), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))


def wait_for_rendezvous(timeout_s: float) -> None:
    """Return once rank 0's rendezvous server (torch's TCPStore at MASTER_ADDR:MASTER_PORT) accepts
    connections, or after `timeout_s`. A rank whose store client finds no server yet backs off for
    ~0.5 s before trying again: a launch paid that whenever another rank got there before rank 0."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return  # another rendezvous (init_method): nothing to wait for
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(address, timeout=1.0).close()
            return
        except OSError:
            time.sleep(_RENDEZVOUS_POLL_S)

"""The two-node Slurm cluster of tests/slurm/two_node_cluster.sh, driven from the tests: two hosts
(tn1, tn2) as network namespaces of this machine, a slurmd in each."""

import os
import subprocess
from pathlib import Path

import pytest

from launchers.rendezvous import free_port

SCRIPT = Path(__file__).resolve().parent / "slurm" / "two_node_cluster.sh"
NODES = ("tn1", "tn2")


class TwoNodeCluster:
    def __init__(self, state: Path, ports: dict[str, str]):
        self.state, self.ports = state, ports
        # What a job submitted to it, or a Slurm command, needs in its environment.
        self.env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "OMP_NUM_THREADS": "1"}

    @classmethod
    def start(cls, state: Path) -> "TwoNodeCluster":
        """Start one on fresh ports, or fail the test with the script's word (never skip)."""
        cluster = cls(state, {"SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port())})
        started = cluster.script("start", check=False)
        if started.returncode != 0:
            pytest.fail(f"could not start the two-node Slurm cluster (run ./setup.sh --test): {started.stderr}")
        return cluster

    def stop(self) -> None:
        self.script("stop")

    def script(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """two_node_cluster.sh ACTION [NODE] STATE_DIR [CMD...]; args name the action and node only."""
        action, *node = args
        command = ["bash", str(SCRIPT), action, *node, str(self.state)]
        done = subprocess.run(
            command, env={**os.environ, **self.ports}, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed: {done.stderr}")
        return done

    def on(self, node: str) -> list[str]:
        """The prefix that runs a command on `node` (its network, hostname and hosts file)."""
        return ["bash", str(SCRIPT), "on", node, str(self.state)]

    def processes(self, node: str) -> list[str]:
        """The command lines running on `node`, its slurmd left out."""
        listed = self.script("ps", node).stdout.splitlines()
        return [line for line in listed if not line.split(" ", 1)[-1].startswith("slurmd ")]

    def kill(self, node: str) -> None:
        """The node dies: its link goes down first (no peer hears of it), then all on it is SIGKILLed."""
        self.script("kill", node)

    def revive(self, node: str) -> None:
        self.script("revive", node)

    def node_states(self) -> dict[str, str]:
        listed = self.slurm("sinfo", "-h", "-N", "-o", "%N %T").stdout.split()
        return dict(zip(listed[::2], listed[1::2]))

    def slurm(self, *command: str) -> subprocess.CompletedProcess:
        """A Slurm command against this cluster."""
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60, check=True)

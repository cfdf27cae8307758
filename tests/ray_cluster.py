"""The Ray cluster of tests/ray/ray_cluster.sh, driven from the tests: a head (rh) and two workers
(rw1, rw2) as network namespaces of this machine, each running Ray's daemons."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "ray" / "ray_cluster.sh"
WORKERS = ("rw1", "rw2")


class RayTestCluster:
    def __init__(self, state: Path):
        self.state = state

    @classmethod
    def start(cls, state: Path) -> "RayTestCluster":
        """Start one (its namespaces named after this process, so that another cluster may run),
        or fail the test with the script's word (never skip)."""
        cluster = cls(state)
        started = cluster.script("start", check=False, env={"RAY_TEST_TAG": str(os.getpid() % 200 + 20)})
        if started.returncode != 0:
            pytest.fail(f"could not start the Ray test cluster (run ./setup.sh --test): {started.stderr}")
        return cluster

    @property
    def address(self) -> str:
        """The job API's URL (the dashboard's port on the head)."""
        return (self.state / "address").read_text().strip()

    @property
    def private(self) -> Path:
        """A folder of this machine that no worker sees (each has its own there)."""
        return self.state / "private"

    def stop(self) -> None:
        self.script("stop")

    def script(self, *args: str, check: bool = True, timeout: float = 180, env: dict | None = None):
        action, *node = args
        command = ["bash", str(SCRIPT), action, *node, str(self.state)]
        done = subprocess.run(
            command, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed: {done.stderr}")
        return done

    def node_of(self, address: str) -> str:
        """The worker whose address is `address`."""
        return {"11": "rw1", "12": "rw2"}[address.rsplit(".", 1)[1]]

    def rank_processes(self, node: str) -> list[str]:
        """The rank processes (launchers.ray_rank) still running on `node`."""
        listed = self.script("ps", node).stdout.splitlines()
        return [line for line in listed if "launchers.ray_rank" in line]

    def kill(self, node: str) -> None:
        """The node dies: its link goes down first (no peer hears of it), then all on it is SIGKILLed."""
        self.script("kill", node)

    def revive(self, node: str) -> None:
        """The node's link up and Ray started on it again, waited for until the head counts it alive."""
        self.script("revive", node)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.alive_workers() == set(WORKERS):
                return
            time.sleep(1)
        raise AssertionError(f"{node} did not rejoin: {self.ray('status').stdout}")

    def alive_workers(self) -> set[str]:
        """The workers Ray counts alive (`ray list nodes` on the head)."""
        nodes = json.loads(self.ray("list", "nodes", "--format", "json").stdout)
        return {self.node_of(n["node_ip"]) for n in nodes if n["state"] == "ALIVE" and not n["is_head_node"]}

    def ray(self, *command: str) -> subprocess.CompletedProcess:
        """A `ray` command against this cluster, from this machine."""
        return subprocess.run(
            ["ray", *command, "--address", self.address] if command[0] == "job" else ["ray", *command],
            env={**os.environ, "RAY_ADDRESS": self.address},
            capture_output=True,
            text=True,
            timeout=60,
        )

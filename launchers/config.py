"""The `launcher` config group: where the rank processes run (names follow torchrun)."""

from dataclasses import dataclass


@dataclass
class LauncherConfig:
    name: str = "local"
    # -1: the product of the parallel degrees when none of them is -1; otherwise every visible GPU,
    # or 2 CPU ranks on a machine without one.
    nproc_per_node: int = -1
    nodes: int = 1
    # auto | cpu | cuda
    device: str = "auto"
    # Wall-clock limit of the job; submitit kills the ranks past it.
    timeout_min: int = 24 * 60
    # Per-rank intra-op threads on CPU; -1: the host's cores shared evenly among the local ranks.
    cpu_threads_per_rank: int = -1

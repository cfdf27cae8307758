"""How many ranks a job gets and who starts them, decided before anything is spawned."""

import math
import os
from dataclasses import dataclass
from pathlib import Path

from launchers import env as rank_env
from launchers.config import LauncherConfig
from titan_exp.parallel.config import ParallelismConfig

# Ranks on a machine without GPUs when neither the launcher nor the degrees say how many.
DEFAULT_CPU_RANKS = 2


@dataclass(frozen=True)
class Placement:
    world_size: int
    nproc_per_node: int
    # Started by torchrun/srun: this process is one rank and spawns nothing.
    external: str | None
    rank: int


def visible_gpus() -> int:
    """GPUs this process may use, counted without importing torch (it would slow every launch)."""
    gpus_dir = Path("/proc/driver/nvidia/gpus")
    installed = len(list(gpus_dir.iterdir())) if gpus_dir.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return installed
    return min(installed, len([d for d in visible.split(",") if d.strip()]))


def plan(launcher: LauncherConfig, parallelism: ParallelismConfig) -> Placement:
    external = rank_env.external_launcher()
    if external:
        env = rank_env.current()
        return Placement(env.world_size, env.local_world_size, external, env.rank)
    nproc = launcher.nproc_per_node
    if nproc == -1:
        degrees = parallelism.degrees().values()
        gpus = visible_gpus() if launcher.device != "cpu" else 0
        if -1 not in degrees:
            nproc = math.prod(degrees)
        else:
            nproc = gpus or DEFAULT_CPU_RANKS
    return Placement(nproc * launcher.nodes, nproc, None, 0)

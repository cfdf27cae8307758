"""What this machine offers the ranks, counted without importing torch (it would slow every launch)."""

import os
from pathlib import Path


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use: those the driver lists, narrowed by CUDA_VISIBLE_DEVICES."""
    gpus_dir = Path("/proc/driver/nvidia/gpus")
    installed = len(list(gpus_dir.iterdir())) if gpus_dir.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return installed
    return min(installed, len([d for d in visible.split(",") if d.strip()]))


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def visible_gpu_ids() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (for handing subsets on)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    count = visible_gpus()
    return ids[:count] if ids is not None else [str(i) for i in range(count)]

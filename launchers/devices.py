"""What this machine offers the ranks, counted without importing torch (it would slow every launch)."""

import os
import shutil
import subprocess
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


def threads_per_rank(cores: int, ranks: int) -> int:
    """An equal share of `cores` for each of `ranks` CPU ranks (at least one thread)."""
    return max(1, cores // ranks)


def visible_gpu_ids() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (for handing subsets on)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    count = visible_gpus()
    return ids[:count] if ids is not None else [str(i) for i in range(count)]


def available_memory() -> int | None:
    """Bytes this machine can still hand out without swapping: MemAvailable, narrowed by the
    cgroup's limit where the process runs in one (a container); None where neither is known."""
    meminfo = Path("/proc/meminfo")
    lines = meminfo.read_text().splitlines() if meminfo.exists() else []
    known = [int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")]
    limit, used = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    if limit.exists() and used.exists() and limit.read_text().strip() != "max":
        known.append(int(limit.read_text()) - int(used.read_text()))
    return min(known) if known else None


def gpu_memory() -> int | None:
    """Bytes of the smallest GPU nvidia-smi lists; None without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        listed = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return min(int(mib) for mib in listed) * 1024**2 if listed else None

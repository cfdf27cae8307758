"""Peak FLOP/s of the device a rank runs on: a GPU's from its titan_exp/conf/hardware profile, a measured matmul
peak on CPU."""

import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from titan_exp.estimate.hardware_profiles import profile_for_device


def gpu_peak_flops(device_name: str) -> float:
    """The dense bf16 peak of the titan_exp/conf/hardware profile this CUDA device name stands for (the
    longest `device_names` entry contained in it, so 'H100 PCIe' wins over 'H100')."""
    try:
        profile = profile_for_device(device_name)
    except KeyError as unknown:
        raise KeyError(f"no peak FLOP/s known for GPU '{device_name}'") from unknown
    return profile.peak_flops("bfloat16")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_cpu_matmul_flops(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """Best of a few square matmuls with this process's thread count."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def cpu_peak_flops(dtype: torch.dtype, cache_dir: str) -> float:
    """Measured once per (CPU model, dtype, thread count) and cached as JSON under cache_dir."""
    key = f"{cpu_name()}|{dtype}|threads={torch.get_num_threads()}"
    return cached(Path(cache_dir) / "cpu_peak_flops.json", key, lambda: measure_cpu_matmul_flops(dtype))


T = TypeVar("T")


def cached(path: Path, key: str, measure: Callable[[], T]) -> T:
    """`measure()`'s value under `key` in the JSON table at `path`, measured the first time only
    (the table is replaced whole, so a reader never sees it half-written)."""
    table = json.loads(path.read_text()) if path.exists() else {}
    if key not in table:
        table[key] = measure()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1)
        os.replace(tmp, path)
    return table[key]

"""Peak FLOP/s of the device a rank runs on: a table for known GPUs, a measured matmul peak on CPU."""

import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

# Dense bf16 tensor-core peaks from the vendors' data sheets (no sparsity).
GPU_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "H20": 148e12,
    "B200": 2.25e15,
    "GB200": 2.5e15,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "MI300X": 1307e12,
    "MI325X": 1307e12,
}


def gpu_peak_flops(device_name: str) -> float:
    """Longest table key contained in the CUDA device name (so 'H100 PCIe' wins over 'H100')."""
    matches = [key for key in GPU_PEAK_BF16_FLOPS if key in device_name]
    if not matches:
        raise KeyError(f"no peak FLOP/s known for GPU '{device_name}'")
    return GPU_PEAK_BF16_FLOPS[max(matches, key=len)]


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

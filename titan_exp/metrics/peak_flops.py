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

# Between the rounds of the CPU's matmul peak: long enough for a burst of another process's work to pass.
_PAUSE_S = 0.2


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


def measure_cpu_matmul_flops(dtype: torch.dtype, size: int = 1024, rounds: int = 3, repeats: int = 5) -> float:
    """The best of `rounds` rounds of `repeats` square matmuls with this process's thread count, a
    pause between rounds: another process's work slows some rounds, never the best one, so a busy
    machine does not lower the peak (unless it is busy the whole time: then a run beats the figure,
    and raise_cpu_peak measures again)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for round_ in range(rounds):
        if round_:
            time.sleep(_PAUSE_S)
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def cpu_peak_flops(dtype: torch.dtype, cache_dir: str) -> float:
    """Measured once per (CPU model, dtype, thread count) and cached as JSON under cache_dir."""
    return cached(_peaks_file(cache_dir), _peak_key(dtype), lambda: measure_cpu_matmul_flops(dtype))


def raise_cpu_peak(dtype: torch.dtype, cache_dir: str, beaten_by: float) -> float:
    """The cached peak after a run's (or a plan's) FLOP/s beat it: it was measured while the machine
    was busy. Measured again; the larger of that and what beat it is cached and returned, so MFU
    never exceeds 100%."""
    peak = max(measure_cpu_matmul_flops(dtype), beaten_by, cpu_peak_flops(dtype, cache_dir))
    recache(_peaks_file(cache_dir), _peak_key(dtype), peak)
    return peak


def _peaks_file(cache_dir: str) -> Path:
    return Path(cache_dir) / "cpu_peak_flops.json"


def _peak_key(dtype: torch.dtype) -> str:
    return f"{cpu_name()}|{dtype}|threads={torch.get_num_threads()}"


T = TypeVar("T")


def cached(path: Path, key: str, measure: Callable[[], T]) -> T:
    """`measure()`'s value under `key` in the JSON table at `path`, measured the first time only."""
    table = json.loads(path.read_text()) if path.exists() else {}
    if key not in table:
        table[key] = measure()
        _write(path, table)
    return table[key]


def recache(path: Path, key: str, value: object) -> None:
    """`value` under `key` in the JSON table at `path`, in place of what was there."""
    table = json.loads(path.read_text()) if path.exists() else {}
    _write(path, table | {key: value})


def _write(path: Path, table: dict) -> None:
    """The table replaced whole, so a reader never sees it half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, path)

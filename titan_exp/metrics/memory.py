"""Peak memory per log interval.

CUDA: the caching allocator's active and reserved peaks (torchtitan's numbers).
CPU: there is no allocator to ask, so the honest equivalent is the process's resident-set high-water
mark (VmHWM), reset each interval through /proc/self/clear_refs. It includes the Python interpreter
and libraries, so it is named cpu_rss_* and never mixed with the CUDA figures.
"""

import os
from pathlib import Path

import torch

from titan_exp import metric_names as names
from titan_exp.units import GIB


class MemoryMonitor:
    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.capacity = torch.cuda.get_device_properties(device).total_memory
        else:
            self.capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.reset_peak()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # "5" resets VmHWM to the current RSS
            except OSError:
                pass  # not Linux, or not permitted: the peak then covers the whole run so far

    def peak(self) -> dict[str, float]:
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            active, reserved = stats["active_bytes.all.peak"], stats["reserved_bytes.all.peak"]
            return {
                names.MAX_ACTIVE_GIB: active / GIB,
                names.MAX_ACTIVE_PCT: 100 * active / self.capacity,
                names.MAX_RESERVED_GIB: reserved / GIB,
                names.MAX_RESERVED_PCT: 100 * reserved / self.capacity,
                names.ALLOC_RETRIES: stats.get("num_alloc_retries", 0),
            }
        rss = _vm_hwm_bytes()
        return {names.CPU_RSS_PEAK_GIB: rss / GIB, names.CPU_RSS_PEAK_PCT: 100 * rss / self.capacity}


def _vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")

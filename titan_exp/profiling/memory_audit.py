"""The memory audit of one training step: torch's MemTracker over the rank's modules and
optimizers, keeping memory by category after every change (the timeline), and its per-module
rows for the report (profiling/report.py)."""

import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from titan_exp.profiling.report import ModuleRow


class TimelineTracker(MemTracker):
    """torch's MemTracker over `modules` and their optimizers that also keeps memory by category
    after every change: (seconds, {category: bytes}) for this device."""

    def __init__(self, device: torch.device, modules: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]):
        super().__init__()
        self.timeline: list[tuple[float, dict]] = []
        self._device = device
        self.track_external(*modules, *optimizers)

    def _update_snap(self, *args, **kwargs) -> None:
        super()._update_snap(*args, **kwargs)
        if (snap := self._curr_mem_snap.get(self._device)) is not None:
            self.timeline.append((time.perf_counter(), dict(snap)))

    def _pre_fw_hook(self, module: torch.nn.Module, inputs) -> None:
        # A pipeline stage runs its forward once per microbatch, which MemTracker takes for the next
        # iteration and refuses: the stage's module statistics restart with each microbatch (the
        # memory totals and categories, kept per device, go on).
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            parents = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
            if parents == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


def module_rows(tracker: MemTracker, device: torch.device, depth: int = 3) -> list[ModuleRow]:
    """Per module (down to `depth` levels): its parameters, what its outputs hold, and the peaks
    reached while its forward and its backward ran."""
    rows = []
    for stats in tracker.memory_tracking.values():
        if stats.mod_fqn.count(".") >= depth:
            continue
        snapshots = stats.snapshots.items()
        peaks = {state.name: max(total_bytes(s, device) for s in snaps) for state, snaps in snapshots if snaps}
        rows.append(
            ModuleRow(
                stats.mod_fqn,
                getattr(stats, "parameter_mem", 0),
                getattr(stats, "output_mem", 0),
                peaks.get("PEAK_FW", 0),
                peaks.get("PEAK_BW", 0),
            )
        )
    return rows


def total_bytes(snapshot: dict, device: torch.device) -> int:
    """Bytes of a MemTracker snapshot ({device: {category: bytes, "Total": bytes}}) on `device`."""
    return snapshot.get(device, {}).get("Total", 0)

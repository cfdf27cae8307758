"""A rank's profiling (ProfilingConfig): a torch.profiler session that records the trace windows;
on an audited step, torch's MemTracker sees every allocation and free, by category and module
(kept after every change: the timeline); on CUDA, the allocator's history is dumped as snapshots
at the audited steps and when the rank runs out of memory. Steps outside the windows and audits
run without the profiler recording or the tracker watching.

The timeline is MemTracker's rather than torch.profiler's memory timeline: the latter's data-flow
analysis fails on FSDP2 steps in torch 2.13 ("version mismatch")."""

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from titan_exp import metric_names as names
from titan_exp.models.common.moe.dispatch import ALL_TO_ALL_RANGE
from titan_exp.profiling.config import ProfilingConfig
from titan_exp.profiling.report import MemoryAudit, write_audit_html

if TYPE_CHECKING:
    from titan_exp.profiling.memory_audit import TimelineTracker

# Entries of the CUDA allocator's history kept for snapshots (torchtitan's choice).
_CUDA_HISTORY_ENTRIES = 100_000


class OutOfMemory(RuntimeError):
    """A rank ran out of device memory; its snapshot was written first."""


class RankProfiler:
    """Started from `first_step` when the config asks for profiling (else `step` does nothing):
    `step(n)` around each training step n; `close()` after the last."""

    def __init__(
        self,
        cfg: ProfilingConfig,
        job_dir: Path,
        rank: int,
        device: torch.device,
        modules: list[torch.nn.Module],
        optimizers: list[torch.optim.Optimizer],
        first_step: int,
    ):
        self.cfg, self.rank, self.device, self.enabled = cfg, rank, device, cfg.enabled
        self.trace_dir = job_dir / cfg.save_traces_folder
        self.memory_dir = job_dir / cfg.save_memory_snapshot_folder
        self._modules, self._optimizers = modules, optimizers
        self._cuda = device.type == "cuda"
        # Metrics of the last audit (rank 0 logs them), taken by whoever reads them.
        self.audit_metrics: dict[str, float] = {}
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self._cuda else [])]
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=self._action,
            on_trace_ready=self._window_ended,
            record_shapes=True,
            profile_memory=True,
        )  # started only with enable_profiling
        if self.enabled:
            self._start(first_step)

    def _start(self, first_step: int) -> None:
        if self._cuda and self.cfg.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=_CUDA_HISTORY_ENTRIES, stacks="python")
        if self.cfg.enable_profiling:
            # The profiler's step numbers are the training steps (its own count starts at 0).
            self._profiler.step_num = first_step
            self._profiler.current_action = self._action(first_step)
            self._profiler.start()

    def close(self) -> None:
        if self.cfg.enable_profiling:
            self._profiler.stop()
        if self._cuda and self.cfg.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)

    def take_audit_metrics(self) -> dict[str, float]:
        taken, self.audit_metrics = self.audit_metrics, {}
        return taken

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        audit = None
        if self._audited(step):
            # MemTracker's import (torch._dynamo, inductor: ~0.5 s) is paid by audited jobs only.
            from titan_exp.profiling.memory_audit import TimelineTracker

            audit = TimelineTracker(self.device, self._modules, self._optimizers)
        try:
            with audit if audit is not None else contextlib.nullcontext():
                yield
        except torch.OutOfMemoryError as oom:
            raise OutOfMemory(f"OOM on rank {self.rank} at step {step}: {oom}{self._oom_snapshot()}") from oom
        if audit is not None:
            self._write_audit(audit, step)
        if self.cfg.enable_profiling:
            self._profiler.step()

    def _audited(self, step: int) -> bool:
        return self.cfg.enable_memory_snapshot and step % self.cfg.memory_snapshot_freq == 0

    def _action(self, step: int) -> ProfilerAction:
        """What the profiler does during training step `step`: the last profiler_active steps of
        every profile_freq are recorded, after profiler_warmup steps of warming up."""
        to_end = (-step) % self.cfg.profile_freq  # steps until the period's last one
        if to_end == 0:
            return ProfilerAction.RECORD_AND_SAVE
        if to_end < self.cfg.profiler_active:
            return ProfilerAction.RECORD
        if to_end < self.cfg.profiler_active + self.cfg.profiler_warmup:
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def _window_ended(self, profiler: torch.profiler.profile) -> None:
        step = profiler.step_num - 1  # step() has moved on to the next training step
        folder = self.trace_dir / f"iteration_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(folder / f"rank{self.rank}_trace.json"))
        self.audit_metrics.update(self._all_to_all_time(profiler))

    def _all_to_all_time(self, profiler: torch.profiler.profile) -> dict[str, float]:
        """Expert parallelism's exchanges over the window, per recorded step, in ms: the host's
        time on CPU ranks (gloo's all-to-all blocks), the device's on CUDA (nccl's runs on a stream)."""
        events = [e for e in profiler.key_averages() if e.key == ALL_TO_ALL_RANGE]
        if not events:
            return {}
        micros = events[0].device_time_total if self._cuda else events[0].cpu_time_total
        return {names.ALL_TO_ALL_MS: micros / 1000 / self.cfg.profiler_active}

    def _write_audit(self, audit: "TimelineTracker", step: int) -> None:
        from titan_exp.profiling.memory_audit import module_rows, total_bytes

        folder = self.memory_dir / f"iteration_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        timeline = [(t, {key.name: size for key, size in snap.items() if key != "Total"}) for t, snap in audit.timeline]
        (folder / f"rank{self.rank}_memory_timeline.json").write_text(json.dumps(timeline))
        peak = total_bytes(audit.get_tracker_snapshot("peak"), self.device)
        report = MemoryAudit.from_timeline(step, self.rank, timeline, module_rows(audit, self.device), peak)
        write_audit_html(report, folder / f"rank{self.rank}_memory.html")
        if self._cuda:
            self._dump_cuda_snapshot(folder)
        self.audit_metrics = report.metrics()

    def _dump_cuda_snapshot(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}_memory_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def _oom_snapshot(self) -> str:
        if not (self._cuda and self.cfg.enable_memory_snapshot):
            return ""
        return f"; memory snapshot: {self._dump_cuda_snapshot(self.memory_dir / 'oom')}"

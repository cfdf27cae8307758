"""The `profiling` config group (conf/profiling/: none, trace, memory, full). Key names are
torchtitan's; folders are relative to the job's folder, and everything written there also goes
into the MLflow run under profiling/."""

from dataclasses import dataclass


@dataclass
class ProfilingConfig:
    name: str = "none"
    # torch.profiler traces (CPU activity, and CUDA on GPUs, with shapes and memory), one per rank
    # for every profile_freq steps: profiler_warmup steps warm up, the last profiler_active steps of
    # each period are recorded (steps profile_freq, 2·profile_freq, ... with the defaults).
    enable_profiling: bool = False
    save_traces_folder: str = "profile_traces"
    profile_freq: int = 10
    profiler_warmup: int = 3
    profiler_active: int = 1
    # A memory audit of every memory_snapshot_freq-th step (torch's MemTracker): memory over the step
    # by category (parameters, buffers, optimizer state, gradients, activations, temporaries), the
    # peak's breakdown and a per-module table; on CUDA also the allocator's history
    # (stacks="python") as snapshots at those steps and when a rank runs out of memory.
    enable_memory_snapshot: bool = False
    memory_snapshot_freq: int = 10
    save_memory_snapshot_folder: str = "memory_snapshot"

    @property
    def enabled(self) -> bool:
        return self.enable_profiling or self.enable_memory_snapshot

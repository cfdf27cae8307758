"""The `profiling` config group (titan_exp/conf/profiling/: none, trace, memory, full). Key names are
torchtitan's; folders are relative to the job's folder, and everything written there also goes
into the MLflow run under profiling/."""

from dataclasses import dataclass

from titan_exp.rules import ConfigError, Section, check_at_least, check_positive, one_of


@dataclass
class ProfilingConfig(Section):
    name: str = one_of("none", "trace", "memory", "full")
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

    def check(self, key: str) -> None:
        super().check(key)
        if self.enable_profiling:
            check_positive(f"{key}.profiler_active", self.profiler_active)
            check_at_least(f"{key}.profiler_warmup", self.profiler_warmup, 0)
            if self.profile_freq < self.profiler_warmup + self.profiler_active:
                raise ConfigError(
                    f"{key}.profile_freq",
                    self.profile_freq,
                    f"must be >= profiling.profiler_warmup + profiling.profiler_active = "
                    f"{self.profiler_warmup + self.profiler_active} (the steps each period warms up and records)",
                )
            if not self.save_traces_folder:
                raise ConfigError(f"{key}.save_traces_folder", "''", "must name a folder (relative to the job's)")
        if self.enable_memory_snapshot:
            check_positive(f"{key}.memory_snapshot_freq", self.memory_snapshot_freq)
            if not self.save_memory_snapshot_folder:
                raise ConfigError(
                    f"{key}.save_memory_snapshot_folder", "''", "must name a folder (relative to the job's)"
                )

    @property
    def enabled(self) -> bool:
        return self.enable_profiling or self.enable_memory_snapshot

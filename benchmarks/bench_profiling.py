"""What profiling costs outside its windows: seconds per step of the steps that are neither profiled
nor audited (nor the step right after a window, which pays for writing its files) with
profiling=trace and profiling=full, against the same steps with profiling=none, measured in one run
with the three interleaved.

The job: Llama 3 debug model, FSDP over 2 CPU ranks, synthetic data, local batch 4 × seq 128,
every step printed (metrics.log_freq=1, tracking=none), 40 steps with profile_freq and
memory_snapshot_freq 10 (windows at steps 7-10, 17-20, ...). Target: ratio ≈ 1 (within noise).

Prints one JSON object. Usage: python benchmarks/bench_profiling.py [--repeats 3] [--steps 40]
"""

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

from bench_tracking import JOB as TRACKING_JOB
from bench_vs_plain import env_with, stream

JOB = [*TRACKING_JOB, "tracking=none"]  # bench_tracking's job, untracked
FREQ, WARMUP, ACTIVE = 10, 3, 1
PERIOD = [
    f"profiling.profile_freq={FREQ}",
    f"profiling.profiler_warmup={WARMUP}",
    f"profiling.memory_snapshot_freq={FREQ}",
]
_STEP = re.compile(r"^step\s+(\d+)/\d+\s.*\sstep ([\d.]+)s")


def outside_windows(step: int) -> bool:
    """Neither in a window (warmup, active, audit) nor right after one, nor the first steps."""
    in_period = step % FREQ
    return step > 2 and in_period not in (0, 1) and in_period < FREQ - WARMUP - ACTIVE + 1


def step_seconds(workdir: Path, steps: int, profiling: str) -> float:
    """Median seconds of the steps outside the windows, in one job."""
    command = [sys.executable, "-m", "titan_exp", *JOB, f"training.steps={steps}", f"profiling={profiling}", *PERIOD]
    _, lines = stream([*command, f"hydra.run.dir={workdir}/{profiling}"], env_with(1), "step     1")
    times = [float(m[2]) for line in lines if (m := _STEP.match(line)) and outside_windows(int(m[1]))]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {"none": [], "trace": [], "full": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for profiling in samples:
                samples[profiling].append(step_seconds(Path(tmp) / str(i), args.steps, profiling))
    median = {name: statistics.median(values) for name, values in samples.items()}
    report = {
        "step_s_outside_windows": median,
        "ratio_trace_vs_none": median["trace"] / median["none"],
        "ratio_full_vs_none": median["full"] / median["none"],
        "samples": samples,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

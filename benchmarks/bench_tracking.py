"""What tracking costs: tokens/s per device with MLflow tracking at every step against the same run
with tracking=none, measured in one run with the two sides interleaved.

The job: Llama 3 debug model, FSDP over 2 CPU ranks, synthetic data, metrics.log_freq=1 (every
step's metrics reach the SQLite store). The figure per job is rank 0's steady-state tokens/s per
device (`throughput/tps_per_device_mean`: wall clock from the end of step 1 to the last step,
everything in between included: queueing the metrics, the writer's batches, printing). Target:
cost below 2%. Job wall times (launch to exit: the writer's start-up and its finishing included)
are printed beside it. The jobs' own output goes to stderr; stdout is the JSON only.

Prints one JSON object. Usage: python benchmarks/bench_tracking.py [--repeats 6] [--steps 60]
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

JOB = [
    "parallelism=fsdp",
    "launcher.nproc_per_node=2",
    "launcher.device=cpu",
    "data=synthetic",
    "training.local_batch_size=4",
    "training.seq_len=128",
    "metrics.log_freq=1",
]


def run(workdir: Path, steps: int, tracking: bool) -> tuple[float, float]:
    """(steady-state tokens/s per device, job wall seconds) of one job."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from titan_exp import CONF_DIR
    from titan_exp import metric_names as names
    from titan_exp.config.resolve import resolve
    from titan_exp.job.launch import run_job

    store = [f"tracking.uri=sqlite:///{workdir}/mlflow.db"] if tracking else ["tracking=none"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="config", overrides=[*JOB, f"training.steps={steps}", *store])
    job = resolve(OmegaConf.to_object(composed))
    start = time.perf_counter()
    last = run_job(job, workdir / f"job-{time.time_ns()}")
    return last[names.TPS_MEAN], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from titan_exp.config.schema import register_schema

    register_schema()
    samples: dict[str, list[float]] = {
        "tps_tracked": [],
        "tps_untracked": [],
        "wall_tracked_s": [],
        "wall_untracked_s": [],
    }
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        workdir = Path(tmp)
        run(workdir, 3, tracking=True)  # creates the store and warms caches; not counted
        for _ in range(args.repeats):
            for tracking, name in ((False, "untracked"), (True, "tracked")):
                tps, wall = run(workdir, args.steps, tracking)
                samples[f"tps_{name}"].append(tps)
                samples[f"wall_{name}_s"].append(wall)
    median = {key: statistics.median(values) for key, values in samples.items()}
    ratio = median["tps_tracked"] / median["tps_untracked"]
    # Each tracked job against the untracked job just before it: the machine's drift cancels out.
    pair_ratios = [on / off for on, off in zip(samples["tps_tracked"], samples["tps_untracked"])]
    print(
        json.dumps(
            {
                "tokens_per_s_per_device": {
                    "tracking_every_step": round(median["tps_tracked"], 1),
                    "tracking_none": round(median["tps_untracked"], 1),
                    "ratio_of_medians": round(ratio, 4),
                    "cost_pct": round(100 * (1 - ratio), 2),
                    "median_paired_cost_pct": round(100 * (1 - statistics.median(pair_ratios)), 2),
                    "target": "cost < 2%",
                },
                "job_wall_s": {
                    "tracking_every_step": round(median["wall_tracked_s"], 2),
                    "tracking_none": round(median["wall_untracked_s"], 2),
                },
                "samples": {key: [round(v, 2) for v in values] for key, values in samples.items()},
                "setup": {"job": JOB, "steps": args.steps, "repeats": args.repeats},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

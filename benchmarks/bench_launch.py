"""Placement costs, measured in one run with the two sides interleaved:

1. Seconds from the command to rank 0's first step, 2 CPU ranks, Slurm: `python -m titan_exp
   launcher=slurm` (submits a job and streams it) against `srun --ntasks=2 python -m titan_exp`
   (ranks started by srun directly). On the one-node test cluster of tests/slurm/cluster.sh, which
   this script starts and stops (needs root and ./setup.sh --test). Target: ratio <= 1.3.
2. Seconds from the command to rank 0's first step under launcher=ray, on the Ray test cluster of
   tests/ray/ray_cluster.sh (a head and two workers as network namespaces): one node's 2 ranks
   against launcher=local's 2 ranks on this machine, and one rank on each of two nodes against
   launcher=slurm's on the two-node cluster of tests/slurm/two_node_cluster.sh (started beside it).
   Rounds interleaved; ratios of the medians.
3. Wall time of a 2-point local sweep of 20-step single-rank points, side by side (the default:
   each point on a core of its own) against one after another (launcher.max_parallel=1).
   Target: ratio <= 0.75.

Prints one JSON object (the jobs' own output goes nowhere). Usage:
  python benchmarks/bench_launch.py [--repeats 3] [--skip-slurm] [--skip-ray]
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_vs_plain import stream  # the same timing of a command's output

from launchers.rendezvous import free_port

REPO = Path(__file__).resolve().parents[1]
JOB = ["data=synthetic", "training.seq_len=64", "training.local_batch_size=2", "metrics.log_freq=1", "tracking=none"]


@contextlib.contextmanager
def slurm_cluster(state: Path, script: str = "cluster.sh"):
    """A test suite's Slurm cluster (tests/slurm/: cluster.sh, one node; two_node_cluster.sh, hosts
    tn1 and tn2); yields the environment that points at it."""
    script_path = REPO / "tests" / "slurm" / script
    env = {**os.environ, "SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port())}
    subprocess.run(["bash", str(script_path), "start", str(state)], env=env, check=True, capture_output=True)
    try:
        yield {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    finally:
        subprocess.run(["bash", str(script_path), "stop", str(state)], check=False)


def first_step_on_slurm(workdir: Path, repeats: int) -> dict:
    ranks = ["parallelism=fsdp", "launcher.device=cpu", "training.steps=1"]
    samples: dict[str, list[float]] = {"launcher_slurm_s": [], "srun_s": []}
    with slurm_cluster(workdir / "slurm") as env:
        titan = [sys.executable, "-m", "titan_exp", *JOB, *ranks]
        for i in range(repeats + 1):  # the first round warms caches and is not counted
            submit = [*titan, "launcher=slurm", "launcher.nproc_per_node=2", f"hydra.run.dir={workdir}/s{i}"]
            submitted, _ = stream(submit, env, "step     1")
            srun = ["srun", "--ntasks=2", "--overcommit", "--immediate=60", *titan, f"hydra.run.dir={workdir}/r{i}"]
            by_srun, _ = stream(srun, env, "step     1")
            if i:
                samples["launcher_slurm_s"].append(submitted)
                samples["srun_s"].append(by_srun)
    median = {key: statistics.median(values) for key, values in samples.items()}
    ratio = median["launcher_slurm_s"] / median["srun_s"]
    return {**{k: round(v, 2) for k, v in median.items()}, "ratio": round(ratio, 3), "target": "<= 1.3",
            "samples": {k: [round(v, 2) for v in vs] for k, vs in samples.items()}}  # fmt: skip


@contextlib.contextmanager
def ray_cluster(state: Path):
    """The test suite's Ray cluster (head rh, workers rw1 and rw2); yields its job API's address."""
    script = REPO / "tests" / "ray" / "ray_cluster.sh"
    subprocess.run(["bash", str(script), "start", str(state)], check=True, capture_output=True)
    try:
        yield (state / "address").read_text().strip()
    finally:
        subprocess.run(["bash", str(script), "stop", str(state)], check=False)


def first_step_on_ray(workdir: Path, repeats: int) -> dict:
    job = [sys.executable, "-m", "titan_exp", *JOB, "parallelism=fsdp", "launcher.device=cpu", "training.steps=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    samples: dict[str, list[float]] = {"ray_1_node_s": [], "local_s": [], "ray_2_nodes_s": [], "slurm_2_nodes_s": []}
    with ray_cluster(workdir / "ray") as address, slurm_cluster(workdir / "slurm2", "two_node_cluster.sh") as slurm_env:
        on_ray = [*job, "launcher=ray", f"launcher.address={address}"]
        sides = {
            "ray_1_node_s": ([*on_ray, "launcher.nproc_per_node=2"], env),
            "local_s": ([*job, "launcher.nproc_per_node=2"], env),
            "ray_2_nodes_s": ([*on_ray, "launcher.nodes=2", "launcher.nproc_per_node=1"], env),
            "slurm_2_nodes_s": ([*job, "launcher=slurm", "launcher.nodes=2", "launcher.nproc_per_node=1"], slurm_env),
        }
        for i in range(repeats + 1):  # the first round warms caches and is not counted
            for name, (command, side_env) in sides.items():
                seconds, _ = stream([*command, f"hydra.run.dir={workdir}/{name}{i}"], side_env, "step     1")
                if i:
                    samples[name].append(seconds)
    median = {key: statistics.median(values) for key, values in samples.items()}
    return {
        **{k: round(v, 2) for k, v in median.items()},
        "ratio_ray_to_local": round(median["ray_1_node_s"] / median["local_s"], 3),
        "ratio_ray_to_slurm": round(median["ray_2_nodes_s"] / median["slurm_2_nodes_s"], 3),
        "samples": {k: [round(v, 2) for v in vs] for k, vs in samples.items()},
    }


def local_sweep(workdir: Path, repeats: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    sweep = [sys.executable, "-m", "titan_exp", "-m", *JOB, "parallelism=single", "launcher.device=cpu",
             "training.steps=20", "debug.seed=0,1"]  # fmt: skip
    samples: dict[str, list[float]] = {"side_by_side_s": [], "one_after_another_s": []}
    for i in range(repeats):
        for name, extra in (("one_after_another_s", ["launcher.max_parallel=1"]), ("side_by_side_s", [])):
            start = time.monotonic()
            subprocess.run([*sweep, *extra, f"hydra.sweep.dir={workdir}/{name}{i}"], cwd=REPO, env=env, check=True,
                           capture_output=True)  # fmt: skip
            samples[name].append(time.monotonic() - start)
    median = {key: statistics.median(values) for key, values in samples.items()}
    ratio = median["side_by_side_s"] / median["one_after_another_s"]
    return {**{k: round(v, 2) for k, v in median.items()}, "ratio": round(ratio, 3), "target": "<= 0.75",
            "samples": {k: [round(v, 2) for v in vs] for k, vs in samples.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-slurm", action="store_true", help="no Slurm here: leave out the Slurm and Ray parts")
    parser.add_argument("--skip-ray", action="store_true", help="leave out the Ray part")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        report = {"local_sweep_2_points": local_sweep(workdir, args.repeats)}
        if not args.skip_slurm:
            report["first_step_2_ranks_slurm"] = first_step_on_slurm(workdir, args.repeats)
        if not args.skip_slurm and not args.skip_ray:
            report["first_step_ray"] = first_step_on_ray(workdir, args.repeats)
    print(json.dumps({**report, "cores": len(os.sched_getaffinity(0))}, indent=1))


if __name__ == "__main__":
    main()

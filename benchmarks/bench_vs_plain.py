"""titan_exp against a minimal plain-PyTorch loop (benchmarks/minimal_llama.py), same model shape,
batch, sequence length and dtype, measured in one run with the two sides interleaved.

1. Single-rank tokens/s over steps 11..40 (titan_exp: parallelism=single, tracking on, synthetic
   data; baseline: one process). Target: ratio >= 0.95.
2. Seconds from the command to the first finished step on 2 CPU ranks (titan_exp:
   `python -m titan_exp parallelism=ddp`, tracking on, an existing store; baseline: `torchrun` of
   the minimal loop with DDP). Target: ratio <= 1.5.

Prints one JSON object. Usage: python benchmarks/bench_vs_plain.py [--repeats 3]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BATCH, SEQ, STEPS, WARMUP = 4, 256, 40, 10
SHAPE = [f"training.local_batch_size={BATCH}", f"training.seq_len={SEQ}", "data=synthetic"]


def stream(command: list[str], env: dict[str, str], first_line: str) -> tuple[float, list[str]]:
    """Run to completion; return (seconds until a line containing first_line appeared, all lines)."""
    start = time.time()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen_at, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if seen_at is None and first_line in line:
            seen_at = time.time() - start
    if proc.wait() != 0 or seen_at is None:
        raise RuntimeError(f"{' '.join(command)} failed:\n{''.join(lines[-30:])}")
    return seen_at, lines


def env_with(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def titan_tps(workdir: Path, threads: int) -> float:
    args = [
        sys.executable,
        "-m",
        "titan_exp",
        f"hydra.run.dir={workdir}/tps-{time.time_ns()}",
        "parallelism=single",
        *SHAPE,
        f"training.steps={STEPS}",
        f"metrics.log_freq={WARMUP}",
        f"launcher.cpu_threads_per_rank={threads}",
        f"tracking.uri=sqlite:///{workdir}/mlflow.db",
    ]
    _, lines = stream(args, env_with(threads), "step     1 ")
    # Logged intervals after the warm-up: steps 11-20, 21-30, 31-40; `step X.XXXs` is seconds per step.
    step_seconds = []
    for line in lines:
        m = re.match(r"step\s+(\d+)\s.*\sstep ([\d.]+)s", line)
        if m and int(m.group(1)) > WARMUP:
            step_seconds.append(float(m.group(2)))
    return (STEPS - WARMUP) * BATCH * SEQ / (WARMUP * sum(step_seconds))


def plain_tps(threads: int) -> float:
    _, lines = stream(
        [sys.executable, "benchmarks/minimal_llama.py", f"--steps={STEPS}", f"--batch={BATCH}", f"--seq={SEQ}"],
        env_with(threads),
        "step 1 ",
    )
    times = {
        int(m.group(1)): float(m.group(2)) for line in lines if (m := re.match(r"step (\d+) loss \S+ time (\S+)", line))
    }
    return (STEPS - WARMUP) * BATCH * SEQ / (times[STEPS] - times[WARMUP])


def titan_first_step(workdir: Path) -> float:
    args = [
        sys.executable,
        "-m",
        "titan_exp",
        f"hydra.run.dir={workdir}/first-{time.time_ns()}",
        "parallelism=ddp",
        "launcher.nproc_per_node=2",
        *SHAPE,
        "training.steps=1",
        f"tracking.uri=sqlite:///{workdir}/mlflow.db",
    ]
    return stream(args, env_with(1), "step     1 ")[0]


def torchrun_first_step() -> float:
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "benchmarks/minimal_llama.py",
        "--steps=1",
        f"--batch={BATCH}",
        f"--seq={SEQ}",
    ]
    return stream(args, env_with(1), "step 1 ")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads of the single rank")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        titan_first_step(workdir)  # creates the store and warms caches for both sides; not counted
        samples: dict[str, list[float]] = {
            "titan_tps": [],
            "plain_tps": [],
            "titan_first_step_s": [],
            "torchrun_first_step_s": [],
        }
        for _ in range(args.repeats):
            samples["plain_tps"].append(plain_tps(args.threads))
            samples["titan_tps"].append(titan_tps(workdir, args.threads))
            samples["torchrun_first_step_s"].append(torchrun_first_step())
            samples["titan_first_step_s"].append(titan_first_step(workdir))
    median = {key: statistics.median(values) for key, values in samples.items()}
    print(
        json.dumps(
            {
                "tokens_per_s": {
                    "titan_exp": round(median["titan_tps"], 1),
                    "plain_pytorch": round(median["plain_tps"], 1),
                    "ratio": round(median["titan_tps"] / median["plain_tps"], 3),
                    "target": ">= 0.95",
                },
                "first_step_s": {
                    "titan_exp": round(median["titan_first_step_s"], 2),
                    "torchrun_plain": round(median["torchrun_first_step_s"], 2),
                    "ratio": round(median["titan_first_step_s"] / median["torchrun_first_step_s"], 3),
                    "target": "<= 1.5",
                },
                "samples": {key: [round(v, 2) for v in values] for key, values in samples.items()},
                "setup": {
                    "batch": BATCH,
                    "seq_len": SEQ,
                    "steps": STEPS,
                    "warmup_steps": WARMUP,
                    "threads": args.threads,
                    "repeats": args.repeats,
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

"""Bad inputs as a user (or a careless script) gives them, each run as a command from a fresh folder:
is each refused cleanly (exit 2, one line on stderr, no traceback, no store written, no run folder
left)? Prints a line per input and the tally. The inputs are the probe's of issue 24 and more of
their kind; add yours.

    python benchmarks/probe_bad_inputs.py            # about 3 minutes on 2 cores
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Each: the arguments of `python -m titan_exp`.
BAD_INPUTS = [
    *(
        [override]
        for override in (
            "model.norm_eps=nan",
            "model.rope_theta=0",
            "model.n_kv_heads=3",
            "model.dim=0",
            "model.n_heads=5",
            "model.ffn_dim_multiplier=-1",
            "model.n_heads=7",
            "model.n_kv_heads=0",
            "model.n_layers=0",
            "model.n_heads=0",
            "model.multiple_of=0",
            "model.vocab_size=-1",
            "model.max_seq_len=0",
            "compile.backend=nope",
            "debug.seed=-1",
            "launcher.cpu_threads_per_rank=0",
            "launcher.cpu_threads_per_rank=-5",
            "tracking.system_metrics_interval_s=0",
            "tracking.parent_run_id=0123abcd",
            "plan.memory_budget_gib=-1",
            "plan.memory_budget_gib=0",
            "plan.memory_margin=1.5",
            "hardware.matmul_efficiency=nan",
            "hardware.memory_gib=0",
            "training.steps=abc",
            "training.steps=0",
            "training.seq_len=-4",
            "training.max_norm=inf",
            "optimizer.lr=nan",
            "optimizer.beta1=2",
            "lr_scheduler.decay_ratio=1.5",
            "data.corpus_path=/dev/null",
            "data.corpus_path=/bin/ls",
            "data.corpus_path=EMPTY",
            "tracking.experiment=../../escaped",
            "tracking.experiment=/abs/exp",
            f"tracking.experiment={'x' * 300}",
            "tracking.uri=foo://x",
            "tracking.uri=http://alice:s3cret@127.0.0.1:9",
            "tracking.uri=sqlite:////proc/titan/m.db",
            "launcher.heartbeat_timeout_s=1",
            "comm.train_timeout_seconds=0",
            "launcher.nproc_per_node=64",
            "training.foo=1",
            "model=llama3_7b",
            "quantize=mxfp8",
            "parallelism.tensor_parallel_degree=3",
            "launcher=slurm",
        )
    ),
    ["parallelism=pp", "launcher.nproc_per_node=2", "parallelism.pipeline_parallel_layers_per_stage=0"],
    ["hardware=h100", "hardware.peak_tflops_bfloat16=0"],
    ["checkpoint.enable=true", "checkpoint.folder=/proc/x"],
    ["-m", "training.steps=3,3"],
    ["-m", "training.steps=range(1,100)"],
    ["-m", "training.steps=3,0"],
    ["ui", "--port=-1"],
    ["ui", "--port=99999"],
    ["ui", "--uri", "sqlite:///NOTES"],
    ["compare", "--uri", "sqlite:///NOTES"],
    ["plan", "quantize=mxfp8", "hardware=h100"],
    ["plan", "model.n_heads=7"],
]


def refused_cleanly(args: list[str], folder: Path) -> tuple[bool, str]:
    """(refused cleanly, what it said or why not)."""
    args = [a.replace("EMPTY", str(folder / "empty.txt")).replace("NOTES", str(folder / "notes.db")) for a in args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "titan_exp", *args, f"tracking.uri=sqlite:///{folder}/mlflow.db"]
        if args[0] not in ("ui", "compare") and not any(a.startswith("tracking.uri=") for a in args)
        else [sys.executable, "-m", "titan_exp", *args],
        cwd=folder, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    said = done.stderr.strip().splitlines()
    problems = [
        f"exit {done.returncode}" if done.returncode != 2 else "",
        f"{len(said)} lines" if len(said) != 1 else "",
        "a traceback" if "Traceback" in done.stderr + done.stdout else "",
        "a store written" if (folder / "mlflow.db").exists() else "",
        "a run folder left" if (folder / "outputs" / "runs").exists() else "",
    ]
    problems = [p for p in problems if p]
    return not problems, "; ".join(problems) + (f" -- {said[-1][:150]}" if said else "") if problems else said[0]


def main() -> int:
    clean, started = 0, time.monotonic()
    for args in BAD_INPUTS:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            (folder / "empty.txt").write_text("")
            (folder / "notes.db").write_text("these are notes\n")
            ok, said = refused_cleanly(args, folder)
        clean += ok
        print(f"{'refused ' if ok else 'NOT CLEAN'}  {' '.join(args)[:70]:70}  {said[:160]}", flush=True)
    print(f"\n{clean} of {len(BAD_INPUTS)} bad inputs refused cleanly ({time.monotonic() - started:.0f} s)")
    return 0 if clean == len(BAD_INPUTS) else 1


if __name__ == "__main__":
    sys.exit(main())

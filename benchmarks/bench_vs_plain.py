"""titan_exp against plain PyTorch (benchmarks/minimal_llama.py: the same model shape, batch,
sequence length and dtype, written without titan_exp), the sides interleaved in every repeat so
that the machine's drift hits both alike. Prints a table, then one JSON object.

1. Steady tokens/s per device over steps WARMUP+1..STEPS (titan_exp: tracking on, synthetic data;
   the plain loop prints a timestamp per step):
   - single rank: parallelism=single against one plain process (target >= 0.98), and with
     tracking=none beside it (what tracking costs the step).
   - 2 CPU ranks: parallelism=ddp against `torchrun` of the plain loop with DDP (target >= 0.97);
     parallelism=fsdp against `torchrun` of the plain loop with FSDP2 (target >= 1.0: titan_exp's
     gloo collectives overlap, plain FSDP2's on gloo do not), and against plain DDP; fsdp with
     parallelism.fsdp_reshard_after_forward=never (ZeRO-2-like: no all-gather in backward) shown
     beside it.
2. Seconds from the command to the end of the first step, 2 CPU ranks (titan_exp: parallelism=ddp,
   tracking on, an existing store; plain: `torchrun` of the plain DDP loop). Target ratio <= 1.2.
   The median of titan_exp's own start-up breakdown (rank 0's `start-up:` line) is printed too.
3. compile.enable=true against eager, tokens/s, for single, ddp and fsdp (no target: a report).

Each ratio is the median over repeats of that repeat's titan_exp/plain ratio.

Usage: python benchmarks/bench_vs_plain.py [--repeats 5] [--compile-repeats 1] [--steps 60] [--only single]
(--only: the cases of those rows only, e.g. `--only single` for the single-rank pair.)
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
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BATCH, SEQ, WARMUP = 4, 256, 10
SHAPE = [f"training.local_batch_size={BATCH}", f"training.seq_len={SEQ}", "data=synthetic"]
TARGETS = {"single": ">= 0.98", "ddp2": ">= 0.97", "fsdp2": ">= 1.0", "fsdp2_vs_ddp": ">= 0.90", "first_step": "<= 1.2"}


def env_with(threads: int) -> dict[str, str]:
    """This process's environment for a command on `threads` intra-op threads, its output unbuffered."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def run(command: list[str], env: dict[str, str]) -> list[str]:
    """Run to completion; its output lines, each with the seconds since the start when it appeared."""
    start = time.time()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [f"{time.time() - start:.3f} {line}" for line in proc.stdout]
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{''.join(lines[-30:])}")
    return lines


def first_seen(lines: list[str], text: str) -> float:
    for line in lines:
        if text in line:
            return float(line.split(" ", 1)[0])
    raise RuntimeError(f"no line with {text!r} in:\n{''.join(lines[-30:])}")


def stream(command: list[str], env: dict[str, str], first_line: str) -> tuple[float, list[str]]:
    """Run to completion; (seconds until a line containing first_line appeared, the lines as printed)."""
    lines = run(command, env)
    return first_seen(lines, first_line), [line.split(" ", 1)[1] for line in lines]


class Titan:
    def __init__(self, workdir: Path, steps: int):
        self.workdir, self.steps = workdir, steps

    def command(self, overrides: list[str], steps: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "titan_exp",
            f"hydra.run.dir={self.workdir}/run-{time.time_ns()}",
            *SHAPE,
            f"training.steps={steps}",
            f"metrics.log_freq={WARMUP}",
            f"tracking.uri=sqlite:///{self.workdir}/mlflow.db",
            *overrides,
        ]

    def tokens_per_s(self, overrides: list[str], threads: int) -> float:
        """Per device, over the logged intervals after the warm-up (`step X.XXXs`: seconds a step)."""
        lines = run(self.command(overrides, self.steps), env_with(threads))
        seconds = [
            float(m.group(2))
            for line in lines
            if (m := re.search(r"step\s+(\d+)/\d+\s.*\sstep ([\d.]+)s", line)) and int(m.group(1)) > WARMUP
        ]
        return BATCH * SEQ / statistics.mean(seconds)

    def first_step(self) -> tuple[float, dict[str, float]]:
        """Seconds to the first step's line, and rank 0's start-up breakdown."""
        lines = run(self.command(["parallelism=ddp", "launcher.nproc_per_node=2"], 1), env_with(1))
        summary = next(line for line in lines if "start-up:" in line).split("=", 1)[1]
        phases = {name: float(value) for name, value in re.findall(r"(\w+) ([\d.]+)", summary)}
        return first_seen(lines, "step     1 "), phases


def plain_command(steps: int, nproc: int, fsdp: bool = False) -> list[str]:
    loop = ["benchmarks/minimal_llama.py", f"--steps={steps}", f"--batch={BATCH}", f"--seq={SEQ}"]
    if nproc == 1:
        return [sys.executable, *loop]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *loop, *["--fsdp"] * fsdp]


def plain_tokens_per_s(steps: int, nproc: int, threads: int, fsdp: bool = False) -> float:
    lines = run(plain_command(steps, nproc, fsdp), env_with(threads))
    step_line = re.compile(r"step (\d+) loss \S+ time (\S+)")
    stamps = {int(m.group(1)): float(m.group(2)) for line in lines if (m := step_line.search(line))}
    return (steps - WARMUP) * BATCH * SEQ / (stamps[steps] - stamps[WARMUP])


def plain_first_step() -> float:
    return first_seen(run(plain_command(1, 2), env_with(1)), "step 1 ")


def measure(repeats: int, compile_repeats: int, steps: int, workdir: Path, only: list[str]) -> dict[str, list]:
    cores = os.cpu_count() or 1
    titan = Titan(workdir, steps)
    two = ["launcher.nproc_per_node=2"]
    cases: dict[str, Callable[[], object]] = {
        "plain_single": lambda: plain_tokens_per_s(steps, 1, cores),
        "titan_single": lambda: titan.tokens_per_s(["parallelism=single"], cores),
        "titan_single_untracked": lambda: titan.tokens_per_s(["parallelism=single", "tracking=none"], cores),
        "plain_ddp2": lambda: plain_tokens_per_s(steps, 2, max(1, cores // 2)),
        "plain_fsdp2": lambda: plain_tokens_per_s(steps, 2, max(1, cores // 2), fsdp=True),
        "titan_ddp2": lambda: titan.tokens_per_s(["parallelism=ddp", *two], 1),
        "titan_fsdp2": lambda: titan.tokens_per_s(["parallelism=fsdp", *two], 1),
        "titan_fsdp2_no_reshard": lambda: titan.tokens_per_s(
            ["parallelism=fsdp", *two, "parallelism.fsdp_reshard_after_forward=never"], 1
        ),
        "plain_first_step_s": plain_first_step,
        "titan_first_step": titan.first_step,
    }
    compiled = {
        "compiled_single": lambda: titan.tokens_per_s(["parallelism=single", "compile.enable=true"], cores),
        "compiled_ddp2": lambda: titan.tokens_per_s(["parallelism=ddp", *two, "compile.enable=true"], 1),
        "compiled_fsdp2": lambda: titan.tokens_per_s(["parallelism=fsdp", *two, "compile.enable=true"], 1),
    }
    if only:  # the cases named by any of these words
        cases, compiled = ({k: v for k, v in d.items() if any(w in k for w in only)} for d in (cases, compiled))
    titan.first_step()  # creates the store and warms the caches (CPU peak, inductor); not counted
    samples: dict[str, list] = {name: [] for name in [*cases, *compiled]}
    for repeat in range(repeats):
        for name, case in [*cases.items(), *(compiled.items() if repeat < compile_repeats else [])]:
            samples[name].append(case())
            print(f"repeat {repeat + 1}/{repeats} {name}: {samples[name][-1]}", file=sys.stderr, flush=True)
    return samples


def summarize(samples: dict[str, list]) -> dict:
    timed = {name: values for name, values in samples.items() if values and name != "titan_first_step"}
    median = {name: statistics.median(values) for name, values in timed.items()}

    def ratio(titan: str, plain: str) -> float:
        """The median of each repeat's ratio: the two ran back to back, so the machine's drift between
        repeats (±10% here) cancels."""
        return round(statistics.median(t / p for t, p in zip(samples[titan], samples[plain])), 3)

    throughput = {
        "single": ("titan_single", "plain_single"),
        "single_untracked": ("titan_single_untracked", "plain_single"),
        "ddp2": ("titan_ddp2", "plain_ddp2"),
        "fsdp2": ("titan_fsdp2", "plain_fsdp2"),
        "fsdp2_vs_ddp": ("titan_fsdp2", "plain_ddp2"),
        "fsdp2_no_reshard": ("titan_fsdp2_no_reshard", "plain_ddp2"),
    }
    result = {
        "tokens_per_s_per_device": {
            layout: {
                "titan_exp": round(median[titan]),
                "plain": round(median[plain]),
                "ratio": ratio(titan, plain),
                "target": TARGETS.get(layout),
            }
            for layout, (titan, plain) in throughput.items()
            if titan in median and plain in median
        },
        "first_step_s": _first_step(samples.get("titan_first_step"), median.get("plain_first_step_s")),
        "compile_vs_eager": {
            layout: {"compiled": round(median[f"compiled_{layout}"]), "eager": round(median[f"titan_{layout}"])}
            | {"ratio": ratio(f"compiled_{layout}", f"titan_{layout}")}
            for layout in ("single", "ddp2", "fsdp2")
            if f"compiled_{layout}" in median
        },
        "samples": {
            name: [round(v, 2) if isinstance(v, float) else round(v[0], 2) for v in values]
            for name, values in samples.items()
        },
    }
    return result


def _first_step(titan: list | None, plain_s: float | None) -> dict:
    if not titan or plain_s is None:
        return {}
    seconds = statistics.median(s for s, _ in titan)
    phases = [breakdown for _, breakdown in titan]
    return {
        "titan_exp": round(seconds, 2),
        "torchrun_plain": round(plain_s, 2),
        "ratio": round(seconds / plain_s, 3),
        "target": TARGETS["first_step"],
        "titan_exp_breakdown_s": {name: round(statistics.median(p[name] for p in phases), 2) for name in phases[0]},
    }


def table(result: dict) -> str:
    def row(*cells: object) -> str:
        return "| " + " | ".join(str(cell) for cell in cells) + " |"

    rows = [row("tokens/s/device (first step: s)", "titan_exp", "plain PyTorch", "ratio", "target"), row(*["---"] * 5)]
    for layout, r in result["tokens_per_s_per_device"].items():
        rows.append(row(layout, f"{r['titan_exp']:,}", f"{r['plain']:,}", r["ratio"], r["target"]))
    if f := result["first_step_s"]:
        rows.append(row("s to the first step, 2 ranks", f["titan_exp"], f["torchrun_plain"], f["ratio"], f["target"]))
    for layout, c in result["compile_vs_eager"].items():
        rows.append(row(f"{layout} compiled", f"{c['compiled']:,}", f"{c['eager']:,} (eager)", c["ratio"], "-"))
    text = "\n".join(rows)
    if f:
        breakdown = " + ".join(f"{name} {s}" for name, s in f["titan_exp_breakdown_s"].items())
        text += f"\n\ntitan_exp start-up (rank 0, median): {breakdown}"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile-repeats", type=int, default=1, help="repeats of the compiled runs (0: none)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--only", nargs="*", default=[], help="cases whose name holds one of these words (single, ddp2, ...)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        samples = measure(args.repeats, args.compile_repeats, args.steps, Path(tmp), args.only)
    result = summarize(samples)
    result["setup"] = {"batch": BATCH, "seq_len": SEQ, "steps": args.steps, "warmup_steps": WARMUP} | vars(args)
    print(table(result))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

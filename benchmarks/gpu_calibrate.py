"""The planner against real runs on one GPU: layouts that fit one device (Llama 3 1B, and the 8B cut
to 4 layers; FSDP on one rank, bf16, seq 4096 × local batch 2) under activation checkpointing
none/selective/full, compile on/off and float8 on/off. Each point trains 12 steps through the CLI
(`python -m titan_exp`, tracked in a SQLite MLflow store in the output folder) and is set beside
`plan`'s prediction for the same overrides (plan.measure=false, the GPU's hardware profile).

Then `titan_exp plan calibrate` on those runs: the profile's figures fitted to them, written as
<hardware>_calibrated.yaml in the output folder.

Prints and writes (calibration.md, .csv, .json in the output folder) each point's measured and
predicted active/reserved GiB and TPS/device with their errors and MFU, the mean absolute errors, and
which orderings hold, measured and predicted (TPS: compile > eager, float8 > bf16, AC none >
selective > full; memory: AC none > selective > full); then one JSON line. About 6-8 minutes on an
H100/H200. Exit 1 if a run or a prediction failed, 2 without a CUDA device (unless --dry).

--dry: no GPU needed: composes every point and runs only the planner (the measured columns empty),
for the hardware profile of --hardware (default h100).

Usage: python benchmarks/gpu_calibrate.py [--dry] [--only NAME ...] [--hardware h200] [--timeout-s 240]
                                          [--out DIR]   (default outputs/gpu_calibrate/<time>/)
"""

import argparse
import csv
import datetime
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_vs_plain import REPO

from titan_exp import metric_names as names
from titan_exp.compare.report import to_markdown
from titan_exp.config.schema import register_schema
from titan_exp.estimate.hardware_profiles import profile_for_device
from titan_exp.plan.point import compose_point, plan_one

STEPS, LOG_FREQ = 12, 4  # the last log interval (steps 9-12) is past compilation and warm-up
EXPERIMENT = "gpu_calibrate"
COMMON = [
    "parallelism=fsdp",
    "launcher.nproc_per_node=1",
    "launcher.device=cuda",
    "training.mixed_precision_param=bfloat16",
    "data=synthetic",
    "training.seq_len=4096",
    "training.local_batch_size=2",
    f"training.steps={STEPS}",
    f"metrics.log_freq={LOG_FREQ}",
    f"tracking.experiment={EXPERIMENT}",
]
MODELS = {"1b": ["model=llama3_1b"], "8b4l": ["model=llama3_8b", "model.n_layers=4"]}


def point(model: str, ac: str = "none", compiled: bool = False, quantize: str = "none") -> list[str]:
    """Every varied key spelled out, so that the planner and the run see the same choices."""
    flags = [f"activation_checkpoint.mode={ac}", f"compile.enable={str(compiled).lower()}", f"quantize={quantize}"]
    return [*COMMON, *MODELS[model], *flags]


POINTS = {
    "1b": point("1b"),
    "1b_ac_selective": point("1b", ac="selective"),
    "1b_ac_full": point("1b", ac="full"),
    "1b_compile": point("1b", compiled=True),
    "1b_compile_float8": point("1b", compiled=True, quantize="float8"),
    "8b4l": point("8b4l"),
    "8b4l_ac_full": point("8b4l", ac="full"),
    "8b4l_compile": point("8b4l", compiled=True),
    # float8 pays off compiled (torchao's eager casts cost more than the faster matmuls save).
    "8b4l_compile_float8": point("8b4l", compiled=True, quantize="float8"),
}
AC_CHAINS = [["1b", "1b_ac_selective", "1b_ac_full"], ["8b4l", "8b4l_ac_full"]]
# (claim, figure, chains): the points of each chain should come in strictly descending order of the figure.
ORDERS = [
    ("compile > eager in TPS", "tps", [["1b_compile", "1b"], ["8b4l_compile", "8b4l"]]),
    ("float8 > bf16 in TPS", "tps", [["1b_compile_float8", "1b_compile"], ["8b4l_compile_float8", "8b4l_compile"]]),
    ("AC none > selective > full in TPS", "tps", AC_CHAINS),
    ("AC none > selective > full in active memory", "active_gib", AC_CHAINS),
    ("AC none > selective > full in reserved memory", "reserved_gib", AC_CHAINS),
]
# The runs' figures: the last logged value of each metric (the steady interval, steps 9-12).
METRICS = {
    "active_gib": names.MAX_ACTIVE_GIB,
    "reserved_gib": names.MAX_RESERVED_GIB,
    "tps": names.TPS,
    "mfu_pct": names.MFU,
}
COMPARED = ("active_gib", "reserved_gib", "tps")
COLUMNS = [
    "point",
    "status",
    "active GiB",
    "pred active GiB",
    "active err %",
    "reserved GiB",
    "pred reserved GiB",
    "reserved err %",
    "TPS/device",
    "pred TPS/device",
    "TPS err %",
    "MFU %",
    "pred MFU %",
]
NO_GPU = "gpu_calibrate: no CUDA device (torch.cuda.is_available() is false); run it on a GPU machine, or pass --dry"
TAIL_LINES = 15


def hardware_option(args: argparse.Namespace) -> str:
    """The `hardware` profile to predict for: --hardware, else the one listing this GPU's name."""
    if args.hardware:
        return args.hardware
    if args.dry:
        return "h100"
    import torch  # only here: the planner itself is torch-free with plan.measure=false

    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        raise SystemExit(2)
    try:
        return profile_for_device(torch.cuda.get_device_name(0)).name
    except KeyError as err:
        print(f"gpu_calibrate: {err.args[0]}; pass --hardware NAME", file=sys.stderr)
        raise SystemExit(2) from None


def predicted(overrides: list[str], hardware: str) -> dict[str, float]:
    metrics = plan_one(compose_point([*overrides, f"hardware={hardware}", "plan.measure=false"])).metrics()
    # Planners that tell the allocator's reserve from the live tensors give both; else one peak for each.
    peak = metrics["prediction/peak_memory_gib"]
    return {
        "active_gib": metrics.get("prediction/peak_active_gib", peak),
        "reserved_gib": metrics.get("prediction/peak_reserved_gib", peak),
        "tps": metrics["prediction/tps_per_device"],
        "mfu_pct": metrics["prediction/mfu_pct"],
    }


def last_lines(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return "\n".join(lines[-TAIL_LINES:])


def stop(proc: subprocess.Popen) -> None:
    """As Ctrl-C would: SIGTERM lets the launching process stop its ranks (they hold the GPU) and
    record the run KILLED; whatever of its session is left after the ranks' grace period is killed."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=45)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def train(name: str, out: Path, timeout_s: float) -> str | None:
    """Train the point through the CLI; None when it succeeded, else why not (its last stderr lines)."""
    folder = out / "runs" / name
    folder.mkdir(parents=True)
    command = [sys.executable, "-m", "titan_exp", *POINTS[name], f"hydra.run.dir={folder}"]
    command += [f"tracking.uri=sqlite:///{out / 'mlflow.db'}", f"tracking.run_name={name}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(folder / "stdout.log", "w") as stdout, open(folder / "stderr.log", "w") as stderr:
        # A session of its own, so that a timeout can take every process it started.
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            returncode = None
    if returncode == 0:
        return None
    why = f"timed out after {timeout_s:g} s" if returncode is None else f"exit {returncode}"
    return f"{why}: {last_lines(folder / 'stderr.log') or last_lines(folder / 'stdout.log')}"


def measured(out: Path, names: list[str]) -> dict[str, dict[str, float | None]]:
    """Each run's last logged figures, found by its run name (tracking.run_name=<point>)."""
    from mlflow import MlflowClient  # seconds to import: only once there are runs to read

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    figures = {}
    for name in names:
        runs = (
            client.search_runs(
                [experiment.experiment_id],
                filter_string=f"attributes.run_name = '{name}'",
                order_by=["attributes.start_time DESC"],
                max_results=1,
            )
            if experiment
            else []
        )
        logged = runs[0].data.metrics if runs else {}
        figures[name] = {key: logged.get(metric) for key, metric in METRICS.items()}
    return figures


def error_pct(predicted_value: float | None, measured_value: float | None) -> float | None:
    if predicted_value is None or not measured_value:
        return None
    return 100 * (predicted_value / measured_value - 1)


def ordering(points: dict[str, dict], side: str, figure: str, chains: list[list[str]]) -> bool | None:
    """Whether every chain whose points all have the figure descends strictly; None if none has."""
    values = [[(points.get(n, {}).get(side) or {}).get(figure) for n in chain] for chain in chains]
    complete = [chain for chain in values if None not in chain]
    if not complete:
        return None
    return all(a > b for chain in complete for a, b in itertools.pairwise(chain))


def summarize(points: dict[str, dict]) -> dict[str, object]:
    summary: dict[str, object] = {}
    for figure in COMPARED:
        errors = [abs(e) for p in points.values() if (e := p["errors_pct"].get(figure)) is not None]
        summary[f"{figure}_mean_abs_error_pct"] = statistics.mean(errors) if errors else None
    summary["orders"] = {
        claim: {side: ordering(points, side, figure, chains) for side in ("measured", "predicted")}
        for claim, figure, chains in ORDERS
    }
    summary["failed"] = [name for name, p in points.items() if p["status"] == "failed"]
    return summary


def table_row(name: str, p: dict) -> list[float | str | None]:
    meas, pred, err = p["measured"] or {}, p["predicted"] or {}, p["errors_pct"]
    row: list[float | str | None] = [name, p["status"]]
    for figure in COMPARED:
        row += [meas.get(figure), pred.get(figure), err.get(figure)]
    return [*row, meas.get("mfu_pct"), pred.get("mfu_pct")]


def formatted(cell: float | str | None) -> str:
    if cell is None:
        return ""
    if isinstance(cell, str):
        return cell
    return f"{cell:,.0f}" if abs(cell) >= 1000 else f"{cell:.2f}"


def write_tables(out: Path, points: dict[str, dict], summary: dict[str, object], hardware: str) -> str:
    """calibration.md (the table and the summary), .csv (plain numbers), .json (everything); the Markdown."""
    rows = [table_row(name, p) for name, p in points.items()]
    lines = [f"{figure}: mean |error| {_percent(summary[f'{figure}_mean_abs_error_pct'])}" for figure in COMPARED]
    for claim, sides in summary["orders"].items():
        lines.append(f"{claim}: " + ", ".join(f"{side} {_holds(holds)}" for side, holds in sides.items()))
    lines += [f"{name} failed: {p['error'].splitlines()[0]}" for name, p in points.items() if p["status"] == "failed"]
    markdown = to_markdown([[formatted(c) for c in row] for row in rows], COLUMNS) + "\n" + "\n".join(lines) + "\n"
    (out / "calibration.md").write_text(f"# Planner calibration (hardware={hardware})\n\n{markdown}")
    with open(out / "calibration.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows([["" if c is None else c for c in row] for row in rows])
    report = {"hardware": hardware, "points": points, "summary": summary}
    (out / "calibration.json").write_text(json.dumps(report, indent=2) + "\n")
    return markdown


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} %"


def _holds(holds: bool | None) -> str:
    return {True: "holds", False: "FAILS", None: "n/a"}[holds]


def calibrate(names: list[str], hardware: str, out: Path, args: argparse.Namespace) -> dict[str, dict]:
    """Every point's prediction (all first: a config error shows before any GPU time), then its run."""
    points = {}
    for name in names:
        p = points[name] = {"overrides": POINTS[name], "status": "dry" if args.dry else "ok", "error": None}
        try:
            p["predicted"] = predicted(POINTS[name], hardware)
        except Exception as err:  # one point's planner failure is that point's result
            p["predicted"], p["status"], p["error"] = None, "failed", f"planner: {type(err).__name__}: {err}"
        shown = p["predicted"] and ", ".join(f"{k} {formatted(v)}" for k, v in p["predicted"].items())
        print(f"{name}: predicted {shown or p['error']}", flush=True)
    if not args.dry:
        for name in names:
            start = time.monotonic()
            if failure := train(name, out, args.timeout_s):
                points[name]["status"], points[name]["error"] = "failed", f"run: {failure}"
            print(f"{name}: trained in {time.monotonic() - start:.0f} s" + (f", {failure}" if failure else ""))
    figures = {} if args.dry else measured(out, names)
    for name, p in points.items():
        p["measured"] = figures.get(name)
        p["errors_pct"] = {
            figure: error_pct((p["predicted"] or {}).get(figure), (p["measured"] or {}).get(figure))
            for figure in COMPARED
        }
    return points


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="no GPU: compose every point, run the planner only")
    parser.add_argument("--only", nargs="+", choices=list(POINTS), default=list(POINTS))
    parser.add_argument("--hardware", help="the hardware profile to predict for (default: the GPU's; --dry: h100)")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="per training run")
    parser.add_argument("--out", type=Path, help="output folder (default outputs/gpu_calibrate/<time>/)")
    args = parser.parse_args()
    hardware = hardware_option(args)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or REPO / "outputs" / "gpu_calibrate" / stamp).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(REPO)  # the planner's relative paths (outputs/cache) are the training runs'
    register_schema()
    points = calibrate(args.only, hardware, out, args)
    summary = summarize(points)
    print(write_tables(out, points, summary, hardware), end="")
    print(f"tables: {out}/calibration.md (.csv, .json)")
    if not args.dry:  # the same runs fed to the profile's calibration (titan_exp plan calibrate)
        calibrate_profile = ["plan", "calibrate", "--hardware", hardware, "--uri", f"sqlite:///{out / 'mlflow.db'}"]
        calibrate_profile += ["--out", str(out / f"{hardware}_calibrated.yaml")]
        # Its refusal (too few finished runs, say) is its own line on stderr; the summary says whether it wrote one.
        done = subprocess.run([sys.executable, "-m", "titan_exp", *calibrate_profile], cwd=REPO, check=False)
        summary["profile_calibrated"] = done.returncode == 0
    print(json.dumps({"hardware": hardware, "dry": args.dry, "out": str(out), **summary}))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

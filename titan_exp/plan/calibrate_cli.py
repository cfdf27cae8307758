"""`titan_exp plan calibrate`: a device profile fitted to the team's own tracked runs.

  titan_exp plan calibrate --hardware h100                      # every finished h100 run of the experiment
  titan_exp plan calibrate --hardware cpu --runs ID,ID,ID --evaluate ID,ID,ID

Reads the finished training runs of one hardware profile (on a GPU: the profile of the device it
ran on; on CPU ranks: `hardware`) from an MLflow store (their steady
tokens/s per device, and the overrides each was composed from, `config/hydra/overrides.yaml`),
fits the profile's figures (plan/calibrate.py: the kernels' efficiencies on a GPU, gloo's costs on
CPU ranks) within their bounds, and the allocator's slack to their measured peak memory (CUDA's max
reserved, a CPU rank's resident set), and prints each run's TPS and memory error before and after,
with each run also predicted from a fit on the others (leave one run out), and, with --evaluate, on
runs the fit never saw. Writes the fitted profile as an option of the `hardware` group in the user's config folder
(titan_exp.user_conf_dir(): `hardware=<name>` then finds it on any command line; --out writes it
elsewhere) and prints the overrides that apply the figures to the profile it started from.
"""

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import yaml

from titan_exp import metric_names as names
from titan_exp import user_conf_dir
from titan_exp.compare.runs import experiment_training_runs
from titan_exp.config.schema import register_schema
from titan_exp.estimate.hardware_profiles import hardware_profiles
from titan_exp.plan.calibrate import CPU_FIGURES, GPU_FIGURES, MIN_RUNS, Observation, fit, fit_allocator_slack
from titan_exp.plan.point import compose_point, step_inputs
from titan_exp.tracking.config import TrackingConfig, masked
from titan_exp.tracking.run import DEVICE_PROFILE_PARAM
from titan_exp.tracking.store import open_experiment

OVERRIDES_ARTIFACT = "config/hydra/overrides.yaml"


class Refused(ValueError):
    """A run or an argument that cannot be calibrated on, said in one line."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    defaults = TrackingConfig()
    parser = argparse.ArgumentParser(prog="titan_exp plan calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", required=True, help="the profile the runs ran on (hardware=<name>)")
    parser.add_argument("--uri", default=defaults.uri, help=f"MLflow tracking URI (default {defaults.uri})")
    parser.add_argument("--experiment", default=defaults.experiment, help="MLflow experiment (default %(default)s)")
    parser.add_argument("--runs", default="", help="run ids to fit on, comma-separated (default: every finished run)")
    parser.add_argument("--evaluate", default="", help="run ids to predict with the fitted profile, never fitted on")
    parser.add_argument("--name", help="the fitted profile's option name (default <hardware>_calibrated)")
    parser.add_argument(
        "--out", type=Path, help="the profile's YAML (default: <user config folder>/hardware/<name>.yaml)"
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    register_schema()
    name = args.name or f"{args.hardware}_calibrated"
    try:
        if name in hardware_profiles():
            raise Refused(
                f"--name={name}: a profile shipped with titan_exp has that name; give the fit a name of its own"
            )
        try:
            mlflow_client, experiment = open_experiment(args.uri, args.experiment)
        except ValueError as err:
            raise Refused(str(err)) from None
        experiment_id = experiment.experiment_id
        wanted = [run_id for run_id in args.runs.split(",") if run_id]
        held_out = [run_id for run_id in args.evaluate.split(",") if run_id]
        to_fit = _select(mlflow_client, experiment_id, args.hardware, wanted, exclude=held_out)
        to_evaluate = _select(mlflow_client, experiment_id, args.hardware, held_out) if held_out else []
        if len(to_fit) < MIN_RUNS:
            raise Refused(
                f"--hardware={args.hardware}: {len(to_fit)} finished run(s) with a measured TPS to fit on; "
                f"a calibration needs at least {MIN_RUNS} (train more layouts on this hardware)"
            )
    except Refused as err:
        print(f"titan_exp plan calibrate: {err}", file=sys.stderr)
        return 2
    fitted_runs, evaluated = (
        [_observation(mlflow_client, run, args.hardware) for run in runs] for runs in (to_fit, to_evaluate)
    )
    hw = fitted_runs[0].hw
    bounds = CPU_FIGURES if hw.device == "cpu" else GPU_FIGURES
    figures = fit(fitted_runs, bounds, hw)
    slack = fit_allocator_slack(fitted_runs)
    if slack is not None:
        figures["allocator_slack"] = slack
    left_out = {}
    for o in fitted_runs:
        others = [other for other in fitted_runs if other is not o]
        left_out[o.label] = fit(others, bounds, hw) | {"allocator_slack": fit_allocator_slack(others)}
    rows = [_row("fitted on", o, figures, left_out[o.label]) for o in fitted_runs]
    rows += [_row("evaluated", o, figures, None) for o in evaluated]
    print(_table(rows))
    for kind in ("fitted on", "evaluated") if evaluated else ("fitted on",):
        print(_summary(rows, kind, "TPS", 2))
        if any(row[6] is not None for row in rows if row[0] == kind):
            print(_summary(rows, kind, "memory", 6))
    out = args.out or user_conf_dir() / "hardware" / f"{name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Its own name; the device kind (hw.device) and every figure not fitted as they were.
    profile = asdict(hw) | figures | {"name": name, "device_names": []}
    origin = (
        f"# titan_exp plan calibrate on {len(fitted_runs)} runs of hardware={args.hardware} in {masked(args.uri)}\n"
    )
    out.write_text(origin + yaml.safe_dump(profile))
    print(f"profile: {out}")
    if args.out is None:
        print(f"use it: hardware={name}")
    print(f"apply it: hardware={args.hardware} " + " ".join(f"hardware.{k}={v:.6g}" for k, v in figures.items()))
    return 0


def _select(mlflow_client, experiment_id: str, hardware: str, wanted: list[str], exclude=()) -> list:
    """The runs to fit on (or evaluate): `wanted` by id, each refused in one line if it cannot be
    used; without ids, every finished run of `hardware` in the experiment."""
    if wanted:
        runs = [_get(mlflow_client, run_id) for run_id in wanted]
        for run in runs:
            _check(run, hardware)
    else:
        runs = [
            run
            for run in experiment_training_runs(mlflow_client, experiment_id)
            if run.info.run_id not in exclude and _usable(run, hardware)
        ]
    return runs


def _get(mlflow_client, run_id: str):
    from mlflow.exceptions import MlflowException

    try:
        return mlflow_client.get_run(run_id)
    except MlflowException:
        raise Refused(f"--runs: no run {run_id} in this store") from None


def _usable(run, hardware: str) -> bool:
    try:
        _check(run, hardware)
    except Refused:
        return False
    return True


def _check(run, hardware: str) -> None:
    run_id = run.info.run_id
    ran_on = run.data.params.get(DEVICE_PROFILE_PARAM) or run.data.params.get("hardware.name")
    if ran_on != hardware:
        raise Refused(f"run {run_id}: it ran with hardware={ran_on}, not {hardware}; calibrate one profile at a time")
    if run.info.status != "FINISHED":
        raise Refused(f"run {run_id}: it ended {run.info.status}; only finished runs measure a step")
    if names.TPS_MEAN not in run.data.metrics:
        raise Refused(f"run {run_id}: no {names.TPS_MEAN} (it logged fewer than two intervals); run it longer")


def _observation(mlflow_client, run, hardware: str) -> Observation:
    """The run recomposed from its overrides, planned for `hardware` (a GPU run's own config says
    `cpu` unless its user said otherwise), beside its measured steady TPS."""
    path = mlflow_client.download_artifacts(run.info.run_id, OVERRIDES_ARTIFACT)
    overrides = yaml.safe_load(Path(path).read_text()) or []
    job = compose_point([*overrides, f"hardware={hardware}", "plan.measure=false", "tracking=none"])
    hw, compute, oversubscription, _ = step_inputs(job)
    tps = run.data.metrics[names.TPS_MEAN]
    reserved = run.data.metrics.get(names.MAX_RESERVED_GIB) or run.data.metrics.get(names.CPU_RSS_PEAK_GIB)
    return Observation(run.info.run_name, job, hw, tps, compute, oversubscription, reserved)


def _row(kind: str, o: Observation, fitted: dict[str, float], left_out: dict[str, float] | None) -> list:
    """kind, run, the TPS error (%) with the profile as it was, fitted, and fitted without the run;
    the measured TPS/device; then the same three for the peak memory (None where none was measured)."""

    def tps_error(figures: dict[str, float]) -> float:
        return 100 * (o.predicted_tps(_speed(figures)) / o.tps - 1)

    def memory_error(figures: dict[str, float] | None) -> float | None:
        if not o.reserved_gib or figures is None:
            return None
        return 100 * (o.predicted_reserved_gib(figures.get("allocator_slack")) / o.reserved_gib - 1)

    speed = [tps_error({}), tps_error(fitted), None if left_out is None else tps_error(left_out)]
    memory = [memory_error({}), memory_error(fitted), memory_error(left_out)]
    return [kind, o.label, *speed, o.tps, *memory]


def _speed(figures: dict[str, float]) -> dict[str, float]:
    """The figures the step time reads (the allocator's slack is memory's)."""
    return {name: value for name, value in figures.items() if name != "allocator_slack"}


def _table(rows: list[list]) -> str:
    lines = [
        "| runs | run | TPS error before | after | left out | measured TPS/device "
        "| memory error before | after | left out |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, label, *errors, tps, mem_before, mem_after, mem_left in rows:
        cells = [_pct(e) for e in errors] + [f"{tps:,.0f}"] + [_pct(e) for e in (mem_before, mem_after, mem_left)]
        lines.append(f"| {kind} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(error: float | None) -> str:
    return "—" if error is None else f"{error:+.1f}%"


def _summary(rows: list[list], kind: str, what: str, first: int) -> str:
    """The mean |error| of one kind of run in `what` (columns first..first+2): before, after, and
    (fitted runs) each left out."""
    mine = [row for row in rows if row[0] == kind and row[first] is not None]

    def mean(column: int) -> str:
        return f"{sum(abs(row[column]) for row in mine) / len(mine):.1f}%"

    line = f"{kind} {len(mine)} runs: mean |{what} error| before {mean(first)}, after {mean(first + 1)}"
    return line + (f", each left out of its fit {mean(first + 2)}" if mine[0][first + 2] is not None else "")

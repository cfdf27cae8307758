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

What a store holds is someone else's data (plan/stored_runs.py): a run named with --runs or
--evaluate that it cannot be trusted with is refused; one found in the experiment is skipped, said
in one line.
"""

import argparse
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import yaml
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from titan_exp import metric_names as names
from titan_exp.compare.runs import experiment_training_runs
from titan_exp.config.schema import register_schema
from titan_exp.estimate.hardware_profiles import hardware_profiles
from titan_exp.estimate.user_profiles import NAME_RULE, is_profile_name, profiles_folder, user_profiles
from titan_exp.job.outcome import composition_error
from titan_exp.plan.calibrate import CPU_FIGURES, GPU_FIGURES, MIN_RUNS, Observation, fit, fit_allocator_slack
from titan_exp.plan.point import compose_point, step_inputs
from titan_exp.plan.stored_runs import MAX_MEMORY_GIB, MAX_TPS_PER_DEVICE, measured, run_label, run_overrides
from titan_exp.rules import ConfigError
from titan_exp.tracking.config import TrackingConfig, masked
from titan_exp.tracking.run import DEVICE_PROFILE_PARAM
from titan_exp.tracking.store import open_experiment


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
        _check_names(args.hardware, name)
        if args.out is not None and args.out.is_dir():
            raise Refused(f"--out={args.out}: a folder; name the profile's file")
        try:
            mlflow_client, experiment = open_experiment(args.uri, args.experiment)
        except ValueError as err:
            raise Refused(str(err)) from None
        experiment_id = experiment.experiment_id
        wanted = [run_id for run_id in args.runs.split(",") if run_id]
        held_out = [run_id for run_id in args.evaluate.split(",") if run_id]
        to_fit = _select(mlflow_client, experiment_id, args.hardware, wanted, exclude=held_out)
        to_evaluate = _select(mlflow_client, experiment_id, args.hardware, held_out) if held_out else []
        fitted_runs = _observations(mlflow_client, to_fit, args.hardware, named=bool(wanted))
        evaluated = _observations(mlflow_client, to_evaluate, args.hardware, named=True)
        if len(fitted_runs) < MIN_RUNS:
            raise Refused(
                f"--hardware={args.hardware}: {len(fitted_runs)} finished run(s) with a measured TPS to fit on; "
                f"a calibration needs at least {MIN_RUNS} (train more layouts on this hardware)"
            )
    except Refused as err:
        print(f"titan_exp plan calibrate: {err}", file=sys.stderr)
        return 2
    hw = fitted_runs[0].hw
    bounds = CPU_FIGURES if hw.device == "cpu" else GPU_FIGURES
    figures = fit(fitted_runs, bounds, hw)
    slack = fit_allocator_slack(fitted_runs)
    if slack is not None:
        figures["allocator_slack"] = slack
    rows = []
    for o in fitted_runs:
        others = [other for other in fitted_runs if other is not o]
        left_out = fit(others, bounds, hw) | {"allocator_slack": fit_allocator_slack(others)}
        rows.append(_row("fitted on", o, figures, left_out))
    rows += [_row("evaluated", o, figures, None) for o in evaluated]
    print(_table(rows))
    for kind in ("fitted on", "evaluated") if evaluated else ("fitted on",):
        print(_summary(rows, kind, "TPS", 2))
        if any(row[6] is not None for row in rows if row[0] == kind):
            print(_summary(rows, kind, "memory", 6))
    out = args.out or profiles_folder() / f"{name}.yaml"
    # Its own name; the device kind (hw.device) and every figure not fitted as they were.
    profile = asdict(hw) | figures | {"name": name, "device_names": []}
    origin = (
        f"# titan_exp plan calibrate on {len(fitted_runs)} runs of hardware={args.hardware} in {masked(args.uri)}\n"
    )
    try:
        _write(out, origin + yaml.safe_dump(profile))
    except OSError as err:
        print(f"titan_exp plan calibrate: --out={out}: cannot be written ({err.strerror})", file=sys.stderr)
        return 1
    print(f"profile: {out}")
    if args.out is None:
        print(f"use it: hardware={name}")
    print(f"apply it: hardware={args.hardware} " + " ".join(f"hardware.{k}={v:.6g}" for k, v in figures.items()))
    return 0


def _check_names(hardware: str, name: str) -> None:
    """--hardware names a profile there is (the user's own checked, as a composition would), and
    --name one of the user's folder can hold."""
    try:
        known = hardware_profiles().keys() | user_profiles().keys()
    except ValueError as err:
        raise Refused(str(err)) from None
    if hardware not in known:
        raise Refused(f"--hardware={hardware!r}: no such profile (options: {', '.join(sorted(known))})")
    if not is_profile_name(name):
        raise Refused(f"--name={name!r}: a profile's name is {NAME_RULE}")
    if name in hardware_profiles():
        raise Refused(f"--name={name}: a profile shipped with titan_exp has that name; give the fit a name of its own")


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


def _observations(mlflow_client, runs: list, hardware: str, named: bool) -> list[Observation]:
    """Each run as an observation; one that cannot be is refused where the user `named` it, else
    skipped (a store's other runs still calibrate), said in one line."""
    observations = []
    for run in runs:
        try:
            observations.append(_observation(mlflow_client, run, hardware))
        except Refused as err:
            if named:
                raise
            print(f"titan_exp plan calibrate: skipped {err}", file=sys.stderr)
    return observations


def _observation(mlflow_client, run, hardware: str) -> Observation:
    """The run recomposed from its overrides, planned for `hardware` (a GPU run's own config says
    `cpu` unless its user said otherwise), beside its measured steady TPS."""
    try:
        tps = measured(run, names.TPS_MEAN, MAX_TPS_PER_DEVICE)
        reserved = measured(run, names.MAX_RESERVED_GIB, MAX_MEMORY_GIB)
        reserved = reserved or measured(run, names.CPU_RSS_PEAK_GIB, MAX_MEMORY_GIB)
        overrides = run_overrides(mlflow_client, run)
    except ValueError as err:
        raise Refused(str(err)) from None
    try:
        job = compose_point([*overrides, f"hardware={hardware}", "plan.measure=false", "tracking=none"])
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        raise Refused(f"run {run.info.run_id}: its overrides make no job here ({composition_error(err)})") from None
    hw, compute, oversubscription, _ = step_inputs(job)
    return Observation(run_label(run), job, hw, tps, compute, oversubscription, reserved)


def _write(out: Path, text: str) -> None:
    """`text` written beside `out`, then renamed over it: a link there is replaced, never written through."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=out.parent, prefix=f".{out.name}.", suffix=".part", delete=False) as f:
        f.write(text)
    try:
        os.replace(f.name, out)
    except OSError:
        os.unlink(f.name)
        raise


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

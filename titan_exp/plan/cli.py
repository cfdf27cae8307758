"""`python -m titan_exp plan [overrides]`: predict a layout's per-rank memory and step time, tokens/s
per device and MFU before spending GPU-hours on it; with comma lists (`-m` optional), a grid ranked
best first, written as Markdown, CSV and HTML and recorded in MLflow as prediction runs.

python -m titan_exp plan model=MODEL hardware=h100 launcher.nproc_per_node=8
python -m titan_exp plan -m model=MODEL hardware=h100 launcher.nproc_per_node=8 launcher.nodes=32 \\
    parallelism=fsdp_tp parallelism.tensor_parallel_degree=2,4,8 activation_checkpoint.mode=none,full

`python -m titan_exp plan calibrate --hardware NAME`: the profile's figures fitted to your own tracked
runs on that hardware (plan/calibrate_cli.py). `python -m titan_exp plan probe --hardware NAME
[overrides]`: this machine's kernel rates measured for those shapes, a profile of its own (plan/probe.py).

Configs are checked as a training run's are (the world spelled out; nothing is placed). On the `cpu`
profile the device's figures and a rank's compute are measured on this machine (plan/measure.py);
elsewhere they are modelled from the profile.
"""

import argparse
import csv
import dataclasses
import datetime
import itertools
import sys
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from titan_exp.compare.report import to_html, to_markdown
from titan_exp.config.job import ResolvedJob
from titan_exp.config.schema import JobConfig, register_schema
from titan_exp.estimate.bands import overlap
from titan_exp.job import held_batch
from titan_exp.job.outcome import composition_error
from titan_exp.job.preflight import preflight
from titan_exp.job.sweep_points import labels, varying
from titan_exp.plan import calibrate_cli
from titan_exp.plan.point import compose_config, plan_one
from titan_exp.plan.predict import (
    MEASURED,
    Prediction,
    check_plannable,
    planned_shapes,
    resolve_for_plan,
)
from titan_exp.progress import Progress
from titan_exp.rules import ConfigError
from titan_exp.tracking.run import ROLE_TAG, MlflowRun
from titan_exp.tracking.store import ensure_store
from titan_exp.units import GIB

COLUMNS = [
    "rank",
    "layout",
    "world size",
    "global batch",
    "tokens/step",
    "accumulation",
    "peak GiB/rank",
    "budget GiB",
    "fits",
    "step s",
    "TPS/device",
    "TPS band",
    "run both",
    "MFU %",
    "compute",
    "fits with",
    "overrides",
]


# The share of its threads' wall time below which a timing was taken on a busy machine (the
# process is never scheduled all of it: the interpreter's own pauses, allocation).
_BUSY_BELOW = 0.8


def busy_caution(shares: list[float]) -> str | None:
    """What a plan says, once, of compute timed while its process got less than _BUSY_BELOW of its
    threads' time (`shares`: each point's)."""
    busy = [share for share in shares if share < _BUSY_BELOW]
    if not busy:
        return None
    where = f"at {len(busy)} of {len(shares)} points " if len(shares) > 1 else ""
    return (
        f"compute was timed while other processes took the cores ({where}this one got as little as "
        f"{min(busy):.0%} of its threads' time): its step times are too slow; plan again on an idle machine"
    )


def grid(overrides: list[str]) -> list[list[str]]:
    """Every combination of the comma lists and sweeps in `overrides` (Hydra's grammar, as its
    basic sweeper expands them)."""
    choices = []
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if override.is_sweep_override():
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([f"{key}={override.get_value_element_as_str()}"])
    return [list(point) for point in itertools.product(*choices)]


def _hold_global_batch(points: list[list[str]]) -> tuple[list[JobConfig], held_batch.HeldBatch]:
    """The grid's points, each training the first one's tokens per step (job/held_batch.py); a point
    that cannot is refused, naming it."""
    named = labels(points)
    held, found = held_batch.hold_global_batch([compose_config(point) for point in points], named, resolve_for_plan)
    for cfg, label in zip(held, named):
        if isinstance(cfg, ConfigError):
            raise ConfigError(cfg.key, cfg.value, f"{cfg.fix} (grid point: {label})")
    return held, found


def _plan_all(jobs: list[ResolvedJob]) -> list[Prediction]:
    """Each point planned, a grid's progress on stderr (stdout gets the table)."""
    predictions, progress = [], Progress("planned", len(jobs), sys.stderr)
    for done, job in enumerate(jobs, 1):
        predictions.append(plan_one(job))
        if len(jobs) > 1:
            progress.show(done)
    return predictions


def _row(rank: int, prediction: Prediction, job: ResolvedJob, point: list[str], run_both: str) -> list[str]:
    """`run_both`: what the row says of its place beside the best (see `_run_both`)."""
    p, t = prediction, job.config.training
    low, high = p.tps_range
    return [
        str(rank),
        p.layout,
        str(p.world_size),
        str(t.global_batch_size),
        f"{job.tokens_per_step:,}",
        str(job.accumulation),
        f"{p.peak_gib:.2f}",
        f"{p.memory_budget_gib:.1f}",
        "yes" if p.fits else "no",
        f"{p.step.total:.3f}",
        f"{p.tps_per_device:,.0f}",
        f"{low:,.0f}–{high:,.0f}",
        run_both,
        f"{p.mfu_pct:.1f}",
        p.sources["compute"],
        " or ".join(p.fixes) if not p.fits else "",
        " ".join(point),
    ]


def _run_both(ranked: list[Prediction]) -> list[str]:
    """Per row (best first): "with #1" where a fitting layout's TPS band overlaps the best one's, so
    the planner cannot tell them apart and both are worth a real run; "" elsewhere."""
    best = ranked[0] if ranked and ranked[0].fits else None
    return [
        "with #1" if best is not None and n > 0 and p.fits and overlap(p.tps_range, best.tps_range) else ""
        for n, p in enumerate(ranked)
    ]


def describe(prediction: Prediction) -> str:
    """One prediction in full: the memory breakdown (with the fake pass's cross-check) and the step's."""
    p = prediction
    memory = p.memory
    rows = [f.name for f in dataclasses.fields(memory) if f.name != "phase"]
    lines = [
        f"{p.layout} ({p.mesh}), {p.world_size} ranks",
        f"  peak memory per rank {p.peak_gib:.2f} GiB reserved ({memory.active / GIB:.2f} GiB active) of "
        f"{p.memory_budget_gib:.1f} ({'fits' if p.fits else 'does NOT fit'}), modelled at its {memory.phase}:",
        *(f"    {name.replace('_', ' '):16s} {getattr(memory, name) / GIB:10.3f} GiB" for name in rows),
    ]
    if p.fake_pass is not None:
        gap = 100 * (p.fake_pass.active - memory.active) / max(memory.active, 1)
        lines.append(
            f"  cross-check: the dry run's fake pass (eager, tensors only) finds {p.fake_pass.active / GIB:.2f} GiB "
            f"active, {gap:+.0f}% against the model ({p.fake_pass.describe()})"
        )
    lines += [
        f"  step {p.step.total:.3f} s: compute {p.step.compute:.3f} ({p.sources['compute']}) + communication "
        f"{p.step.communication:.3f} + pipeline bubble {p.step.bubble:.3f} (modelled)"
        + (f", × {p.step.oversubscription:.2f} for ranks sharing cores" if p.step.oversubscription > 1 else ""),
        f"  tokens/s per device {p.tps_per_device:,.0f}, MFU {p.mfu_pct:.1f}%",
        f"  bands: TPS {p.tps_range[0]:,.0f}–{p.tps_range[1]:,.0f} (±{p.tps_band.pct:.0f}%), peak memory "
        f"±{p.memory_band.pct:.0f}%: the 80th percentile of the planner's errors on {p.tps_band.basis}",
    ]
    if not p.fits:
        lines.append(f"  fits with: {' or '.join(p.fixes) or 'no change of AC, batch, ranks or TP/PP degree'}")
    return "\n".join(lines)


def _record(
    jobs: list[ResolvedJob], predictions: list[Prediction], points: list[list[str]], out: Path, title: str
) -> None:
    """Each prediction as an MLflow run tagged as one (a grid's under a parent run holding the table)."""
    tracking = jobs[0].config.tracking
    if not tracking.enable:
        return
    ensure_store(tracking)
    parent = None
    if len(jobs) > 1:
        parent = MlflowRun.create(tracking, title[:250], {ROLE_TAG: "plan"})
        parent.log_artifacts(out, "plan")
        parent.finish("FINISHED")
    now_ms = int(datetime.datetime.now().timestamp() * 1000)
    for job, prediction, point in zip(jobs, predictions, points):
        if parent:
            job = job.with_parent_run(parent.run_id)
        tags = job.run_tags("plan") | {
            ROLE_TAG: "prediction",
            "hardware": job.config.hardware.name,
            "status": "predicted",
        }
        tags["prediction_sources"] = ", ".join(f"{k}: {v}" for k, v in prediction.sources.items())
        run = MlflowRun.create(job.config.tracking, f"prediction: {job.run_name()}", tags)
        params = job.params() | {"plan.overrides": " ".join(point)}
        run.log_params(params)
        run.log_metrics([(0, prediction.metrics(), now_ms)])
        run.finish("FINISHED")
    where = f"parent run {parent.run_id}" if parent else "1 run"
    print(f"recorded in MLflow ({tracking.uri}, experiment {tracking.experiment}): {where}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:
        return calibrate_cli.main(argv[1:])
    if argv[:1] == ["probe"]:
        from titan_exp.plan import probe  # torch: the probe measures

        return probe.main(argv[1:])
    parser = argparse.ArgumentParser(prog="titan_exp plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--multirun", action="store_true", help="a grid (implied by comma lists)")
    parser.add_argument(
        "--out", type=Path, default=None, help="folder of the ranked table (default outputs/plans/<time>)"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    register_schema()
    try:
        points = grid(args.overrides)
        held, found = _hold_global_batch(points)
        jobs = [resolve_for_plan(cfg) for cfg in held]
        for job in jobs:
            check_plannable(job)
            preflight(job, memory=False)  # the points' files, folders and store, as a run's
    except (ConfigError, HydraException) as err:
        print(f"titan_exp plan: config error: {composition_error(err)}", file=sys.stderr)
        return 2
    print(f"planned shapes: {planned_shapes(jobs[0])}")
    if not any(o.startswith("training.") for o in args.overrides) and "debug" not in jobs[0].model_name:
        print(
            "note: no training.* override given: these are the debug training shapes, not a real run's; "
            "give yours, e.g. training.seq_len=8192 training.local_batch_size=2 training.mixed_precision_param=bfloat16"
        )
    if len(points) > 1:
        print(held_batch.describe(found, jobs[0].config.training.seq_len))
    predictions = _plan_all(jobs)
    if len(points) == 1:
        print(describe(predictions[0]))
    ranked = sorted(range(len(points)), key=lambda i: (not predictions[i].fits, -predictions[i].tps_per_device))
    shown = varying(points)  # the table shows what varies
    marks = _run_both([predictions[i] for i in ranked])
    rows = [_row(n + 1, predictions[i], jobs[i], shown[i], marks[n]) for n, i in enumerate(ranked)]
    out = args.out or Path("outputs") / "plans" / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    title = "plan: " + " ".join(args.overrides)
    (out / "plan.md").write_text(to_markdown(rows, COLUMNS))
    (out / "plan.html").write_text(to_html(rows, title, COLUMNS))
    with open(out / "plan.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows(rows)
    print(to_markdown(rows, COLUMNS), end="")
    if caution := busy_caution([p.cpu_share for p in predictions]):
        print(f"caution: {caution}")
    print(f"table: {out}/plan.md (.csv, .html); figures measured on this machine: "
          f"{sorted({k for p in predictions for k, v in p.sources.items() if v == MEASURED}) or 'none'}")  # fmt: skip
    _record(jobs, predictions, points, out, title)
    return 0

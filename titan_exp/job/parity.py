"""experiment=loss_parity: train the same model from one seed checkpoint, deterministically, under
several layouts, and compare their loss curves with the first layout's (table + overlay plot), and
their held-out losses (validation.*) too.

A sweep over layouts (job/sweep.py, job/sweep_points.py): each layout is composed from the
command's own overrides plus the layout's, resolved and checked before any layout starts, and run
as an ordinary job (its own ranks, its own MLflow run, a child of the sweep's parent run); the
curves are read back from MLflow.
"""

from pathlib import Path

from hydra import compose

from titan_exp import metric_names as names
from titan_exp.compare.plots import parity
from titan_exp.compare.runs import loss_curve
from titan_exp.config.compose import to_job_config
from titan_exp.config.resolve import resolve
from titan_exp.config.schema import JobConfig
from titan_exp.job.launch import run_job
from titan_exp.job.preflight import preflight
from titan_exp.job.sweep import Sweep
from titan_exp.job.sweep_points import SweepPoint, check_every_point, prepare_point, run_points
from titan_exp.tracking.journal import RUN_ID_FILE
from titan_exp.tracking.store import client


def run_parity(cfg: JobConfig, task_overrides: list[str], job_dir: Path) -> bool:
    """Returns True when every layout stays within cfg.parity.rtol of the reference. With tracking
    on, the layouts' runs are children of one parent run that gets the comparison and the report."""
    seed_folder = job_dir / "seed_checkpoint"
    # The command's parity experiment (loss_parity's settings where parity.layouts alone was given),
    # parity.layouts emptied: a layout's job is an ordinary training job.
    experiment = [o for o in task_overrides if o.startswith("experiment=")] or ["experiment=loss_parity"]
    base = [o for o in task_overrides if not o.startswith("experiment=")] + [*experiment, "parity.layouts=[]"]
    seed_job = ["parallelism=single", "checkpoint.create_seed_checkpoint=true", f"checkpoint.folder={seed_folder}"]
    seed = resolve(_composed([*base, *seed_job, "tracking=none"]))
    preflight(seed)
    run_job(seed, job_dir / "seed")
    load = f"checkpoint.initial_load_path={seed_folder}/step-0"
    points = [
        prepare_point(n, layout.split(), job_dir / layout_folder(layout), _composed([*base, *layout.split(), load]))
        for n, layout in enumerate(cfg.parity.layouts)
    ]
    check_every_point(points)
    layouts = {"parity.layouts": " | ".join(cfg.parity.layouts)}
    label = experiment[0].removeprefix("experiment=")  # loss_parity, loss_parity_moe: the parent run's name
    sweep = Sweep(cfg.tracking, label, job_dir, layouts, own_parent=True)
    try:
        run_points(points, sweep.open(), cfg.launcher.max_parallel)
        for point in points:
            sweep.point_ended(point.state == "done")
        if failed := [p for p in points if p.state != "done"]:
            raise RuntimeError(f"layout {' '.join(failed[0].overrides)} failed: {failed[0].detail}")
        curves = {" ".join(p.overrides): _curve(p, names.LOSS) for p in points}
        held_out = {" ".join(p.overrides): _curve(p, names.VALIDATION_LOSS) for p in points}
        passed = _report(curves, held_out, cfg.parity.rtol, job_dir)
        if sweep.parent:
            for name in ("loss_parity.md", "loss_parity.png"):
                sweep.parent.run.log_artifact(job_dir / name, "parity")
    except BaseException as err:
        interrupted = isinstance(err, KeyboardInterrupt)
        sweep.finish(interrupted, None if interrupted else f"{type(err).__name__}: {err}")
        raise
    sweep.finish(failure=None if passed else f"a layout's loss left the parity tolerance {cfg.parity.rtol:g}")
    return passed


def _composed(overrides: list[str]) -> JobConfig:
    return to_job_config(compose(config_name="config", overrides=overrides), overrides)


def layout_folder(layout: str) -> str:
    """The folder, under the parity run's, of a layout's job."""
    return layout.replace(" ", "_").replace("=", "-")


def _curve(point: SweepPoint, key: str) -> list[float]:
    """The point's curve of metric `key`, from its MLflow run (the point's process left the run's
    id in its folder)."""
    run_id_file = point.job_dir / RUN_ID_FILE
    if point.job.store is None or not run_id_file.exists():
        raise RuntimeError("experiment=loss_parity reads the curves from MLflow: it needs tracking=mlflow")
    return [loss for _, loss in loss_curve(client(point.job.store.uri), run_id_file.read_text().strip(), key)]


def _deviation(curve: list[float], reference: list[float]) -> float:
    """The largest relative deviation at any step (inf where the curves differ in length)."""
    if len(curve) != len(reference):
        return float("inf")
    return max((abs(a - b) / abs(b) for a, b in zip(curve, reference)), default=0.0)


def _report(curves: dict[str, list[float]], held_out: dict[str, list[float]], rtol: float, job_dir: Path) -> bool:
    """`held_out`: each layout's validation losses (empty without validation), held to the same tolerance."""
    reference_name = next(iter(curves))
    lines = [
        f"| layout | steps | final loss | max rel. deviation from `{reference_name}` | final validation loss "
        f"| its max rel. deviation | within {rtol:g} |",
        "|---|---|---|---|---|---|---|",
    ]
    passed = True
    for name, curve in curves.items():
        deviation = _deviation(curve, curves[reference_name])
        validation = held_out[name]
        held_out_deviation = _deviation(validation, held_out[reference_name])
        ok = max(deviation, held_out_deviation) <= rtol
        passed &= ok
        final_validation = f"{validation[-1]:.6f}" if validation else "–"
        lines.append(
            f"| `{name}` | {len(curve)} | {curve[-1]:.6f} | {deviation:.2e} | {final_validation} "
            f"| {held_out_deviation:.2e} | {'yes' if ok else 'NO'} |"
        )
    table = "\n".join(lines)
    (job_dir / "loss_parity.md").write_text(table + "\n")
    parity(curves, rtol, job_dir / "loss_parity.png", "Loss parity across layouts (same seed checkpoint)")
    print(table, flush=True)
    print(f"overlay plot: {job_dir / 'loss_parity.png'}", flush=True)
    return passed

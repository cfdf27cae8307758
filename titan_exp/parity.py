"""experiment=loss_parity: train the same model from one seed checkpoint, deterministically, under
several layouts, and compare their loss curves with the first layout's (table + overlay plot).

Each layout is composed from the command's own overrides plus the layout's, and run as an ordinary
job (its own ranks, its own MLflow run); the curves are read back from MLflow.
"""

from pathlib import Path

from hydra import compose
from omegaconf import OmegaConf

from titan_exp.config.schema import JobConfig, RunContext


def run_parity(cfg: JobConfig, task_overrides: list[str], job_dir: Path) -> bool:
    """Returns True when every layout stays within cfg.parity.rtol of the reference. With tracking
    on, the layouts' runs are children of one parent run that gets the comparison and the report."""
    from titan_exp.job import prepare, run_job

    seed_folder = job_dir / "seed_checkpoint"
    base = [o for o in task_overrides if not o.startswith("experiment=")] + ["experiment=loss_parity"]
    _run(base + ["parallelism=single", "checkpoint.create_seed_checkpoint=true", f"checkpoint.folder={seed_folder}", "tracking=none"], job_dir / "seed", prepare, run_job)
    group = None
    if cfg.tracking.enable:
        from titan_exp.tracking.sweep import RunGroup

        group = RunGroup(cfg.tracking, "loss_parity", job_dir, {"parity.layouts": " | ".join(cfg.parity.layouts)})
        base.append(f"tracking.parent_run_id={group.run_id}")
    curves: dict[str, list[float]] = {}
    try:
        for layout in cfg.parity.layouts:
            overrides = base + layout.split() + [f"checkpoint.initial_load_path={seed_folder}/step-0"]
            run_id = _run(overrides, job_dir / layout.replace(" ", "_").replace("=", "-"), prepare, run_job)
            curves[layout] = _loss_curve(cfg.tracking.uri, run_id)
        passed = _report(curves, cfg.parity.rtol, job_dir)
        if group:
            for name in ("loss_parity.md", "loss_parity.png"):
                group.run.log_artifact(job_dir / name, "parity")
    except BaseException as err:
        if group:
            group.finish(failed_jobs=1, interrupted=isinstance(err, KeyboardInterrupt))
        raise
    if group:
        group.finish(failure=None if passed else f"a layout's loss left the parity tolerance {cfg.parity.rtol:g}")
    return passed


def _run(overrides: list[str], job_dir: Path, prepare, run_job) -> str | None:
    # parity.layouts emptied: a layout's job is an ordinary training job.
    cfg, placement = prepare(OmegaConf.to_object(compose(config_name="config", overrides=overrides + ["parity.layouts=[]"])))
    print(f"== {' '.join(overrides)}", flush=True)
    run_job(cfg, placement, job_dir)
    run_id_file = RunContext(str(job_dir), cfg.launcher.name).run_id_file
    return run_id_file.read_text().strip() if run_id_file.exists() else None


def _loss_curve(uri: str, run_id: str) -> list[float]:
    from titan_exp.compare.runs import loss_curve
    from titan_exp.tracking.mlflow_run import client

    return [loss for _, loss in loss_curve(client(uri), run_id)]


def _report(curves: dict[str, list[float]], rtol: float, job_dir: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (reference_name, reference), *_ = curves.items()
    lines = [f"| layout | steps | final loss | max rel. deviation from `{reference_name}` | within {rtol:g} |", "|---|---|---|---|---|"]
    passed = True
    for name, curve in curves.items():
        deviation = max(abs(a - b) / abs(b) for a, b in zip(curve, reference)) if len(curve) == len(reference) else float("inf")
        ok = deviation <= rtol
        passed &= ok
        lines.append(f"| `{name}` | {len(curve)} | {curve[-1]:.6f} | {deviation:.2e} | {'yes' if ok else 'NO'} |")
    table = "\n".join(lines)
    (job_dir / "loss_parity.md").write_text(table + "\n")
    figure, axis = plt.subplots(figsize=(8, 5))
    for name, curve in curves.items():
        axis.plot(range(1, len(curve) + 1), curve, marker="o", markersize=3, label=name)
    axis.set(xlabel="step", ylabel="loss (global average)", title="Loss parity across layouts (same seed checkpoint)")
    axis.legend(fontsize=7, loc="lower left")
    figure.tight_layout()
    figure.savefig(job_dir / "loss_parity.png", dpi=120)
    print(table, flush=True)
    print(f"overlay plot: {job_dir / 'loss_parity.png'}", flush=True)
    return passed

"""experiment=loss_parity: train the same model from one seed checkpoint, deterministically, under
several layouts, and compare their loss curves with the first layout's (table + overlay plot).

Each layout is composed from the command's own overrides plus the layout's, and run as an ordinary
job (its own ranks, its own MLflow run); the curves are read back from MLflow.
"""

from pathlib import Path

from hydra import compose

from titan_exp.compare.runs import loss_curve
from titan_exp.config.compose import to_job_config
from titan_exp.config.resolve import resolve
from titan_exp.config.schema import JobConfig
from titan_exp.job.context import RunContext
from titan_exp.job.launch import run_job
from titan_exp.job.sweep import close_parent
from titan_exp.metrics import startup
from titan_exp.tracking.parent_run import ParentRun
from titan_exp.tracking.store import client


def run_parity(cfg: JobConfig, task_overrides: list[str], job_dir: Path) -> bool:
    """Returns True when every layout stays within cfg.parity.rtol of the reference. With tracking
    on, the layouts' runs are children of one parent run that gets the comparison and the report."""
    seed_folder = job_dir / "seed_checkpoint"
    base = [o for o in task_overrides if not o.startswith("experiment=")] + ["experiment=loss_parity"]
    seed_job = ["parallelism=single", "checkpoint.create_seed_checkpoint=true", f"checkpoint.folder={seed_folder}"]
    _run([*base, *seed_job, "tracking=none"], job_dir / "seed")
    parent = None
    if cfg.tracking.enable:
        parent = ParentRun(cfg.tracking, "loss_parity", job_dir, {"parity.layouts": " | ".join(cfg.parity.layouts)})
        base.append(f"tracking.parent_run_id={parent.run_id}")
    curves: dict[str, list[float]] = {}
    try:
        for layout in cfg.parity.layouts:
            overrides = base + layout.split() + [f"checkpoint.initial_load_path={seed_folder}/step-0"]
            run_id = _run(overrides, job_dir / layout.replace(" ", "_").replace("=", "-"))
            curves[layout] = [loss for _, loss in loss_curve(client(cfg.tracking.uri), run_id)]
        passed = _report(curves, cfg.parity.rtol, job_dir)
        if parent:
            for name in ("loss_parity.md", "loss_parity.png"):
                parent.run.log_artifact(job_dir / name, "parity")
    except BaseException as err:
        if parent:
            close_parent(parent, failed_jobs=1, interrupted=isinstance(err, KeyboardInterrupt))
        raise
    if parent:
        close_parent(
            parent, failure=None if passed else f"a layout's loss left the parity tolerance {cfg.parity.rtol:g}"
        )
    return passed


def _run(overrides: list[str], job_dir: Path) -> str | None:
    """One layout's job; returns its MLflow run id (None untracked)."""
    startup.restart()
    # parity.layouts emptied: a layout's job is an ordinary training job.
    composed = compose(config_name="config", overrides=overrides + ["parity.layouts=[]"])
    cfg = resolve(to_job_config(composed))
    startup.mark("compose")
    print(f"== {' '.join(overrides)}", flush=True)
    run_job(cfg, job_dir)
    run_id_file = RunContext(str(job_dir), cfg.launcher.name).run_id_file
    return run_id_file.read_text().strip() if run_id_file.exists() else None


def _report(curves: dict[str, list[float]], rtol: float, job_dir: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (reference_name, reference), *_ = curves.items()
    lines = [
        f"| layout | steps | final loss | max rel. deviation from `{reference_name}` | within {rtol:g} |",
        "|---|---|---|---|---|",
    ]
    passed = True
    for name, curve in curves.items():
        deviation = (
            max(abs(a - b) / abs(b) for a, b in zip(curve, reference)) if len(curve) == len(reference) else float("inf")
        )
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

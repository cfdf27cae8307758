"""The strategy table (Markdown, CSV, HTML) and plots (PNG) over a set of runs, and the comparison of
a sweep written into its parent run."""

import csv
import html
from dataclasses import dataclass
from pathlib import Path

from titan_exp.compare.runs import RunSummary, add_scaling_efficiency, summarize, sweep_points
from titan_exp.tracking.run import MlflowRun
from titan_exp.tracking.store import client as mlflow_client

COLUMNS = [
    "strategy",
    "world size",
    "TPS/device",
    "predicted TPS/device",
    "MFU %",
    "peak memory GiB",
    "predicted peak GiB",
    "scaling efficiency",
    "final loss",
    "status",
    "run",
]


def table(summaries: list[RunSummary]) -> list[list[str]]:
    """One row of text per run, in COLUMNS order."""

    def number(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    def predicted(value: float | None, measured: float | None, fmt: str) -> str:
        """The prediction and how far it was from the measured figure (where they are comparable)."""
        if value is None:
            return "n/a"
        error = f" ({100 * (value / measured - 1):+.0f}%)" if measured else ""
        return format(value, fmt) + error

    rows = []
    for s in summaries:
        memory = f"{number(s.peak_memory_gib, '.2f')} ({s.memory_kind})" if s.peak_memory_gib is not None else "n/a"
        status = s.status if not s.failure_reason else f"{s.status}: {s.failure_reason[:80]}"
        rows.append(
            [
                s.name,
                str(s.world_size),
                number(s.tps_per_device, ",.0f"),
                predicted(s.predicted_tps_per_device, s.tps_per_device, ",.0f"),
                number(s.mfu_pct, ".2f"),
                memory,
                # Predictions count tensors: comparable with an allocator's peak, not a CPU resident set.
                predicted(s.predicted_peak_memory_gib, s.peak_memory_gib if s.memory_kind == "active" else None, ".2f"),
                number(s.scaling_efficiency, ".2f"),
                number(s.final_loss, ".4f"),
                status,
                s.run_id[:8],
            ]
        )
    return rows


def to_markdown(rows: list[list[str]], columns: list[str] = COLUMNS) -> str:
    escape = lambda cell: cell.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(escape(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def to_html(rows: list[list[str]], title: str, columns: list[str] = COLUMNS) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>\n" for row in rows)
    return (
        f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>table{border-collapse:collapse;font-family:sans-serif}"
        "td,th{border:1px solid #999;padding:4px 8px;text-align:right}td:first-child{text-align:left}</style></head>\n"
        f"<body><h1>{html.escape(title)}</h1>\n<table><tr>{head}</tr>\n{body}</table></body></html>\n"
    )


# The CSV carries plain numbers (no separators, full precision) for spreadsheets and pandas.
CSV_COLUMNS = [
    "strategy",
    "world_size",
    "tps_per_device",
    "predicted_tps_per_device",
    "mfu_pct",
    "peak_memory_gib",
    "memory_kind",
    "predicted_peak_memory_gib",
    "scaling_efficiency",
    "final_loss",
    "status",
    "failure_reason",
    "run_id",
]


def write_csv(summaries: list[RunSummary], path: Path) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(CSV_COLUMNS)
        for s in summaries:
            writer.writerow(
                [
                    s.name,
                    s.world_size,
                    s.tps_per_device,
                    s.predicted_tps_per_device,
                    s.mfu_pct,
                    s.peak_memory_gib,
                    s.memory_kind,
                    s.predicted_peak_memory_gib,
                    s.scaling_efficiency,
                    s.final_loss,
                    s.status,
                    s.failure_reason,
                    s.run_id,
                ]
            )


def write_plots(summaries: list[RunSummary], out_dir: Path) -> list[Path]:
    """loss_curves.png, throughput.png, memory.png, scaling.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.name for s in summaries]
    paths = []

    def save(figure, name: str) -> None:
        figure.tight_layout()
        figure.savefig(out_dir / name, dpi=110)
        plt.close(figure)
        paths.append(out_dir / name)

    figure, axis = plt.subplots(figsize=(8, 5))
    for s in summaries:
        if s.loss_curve:
            steps, losses = zip(*s.loss_curve)
            axis.plot(steps, losses, marker="o", markersize=2, label=f"{s.name} ({s.run_id[:8]})")
    axis.set(xlabel="step", ylabel="loss (global average)", title="Loss curves")
    axis.legend(fontsize=7)
    save(figure, "loss_curves.png")

    for name, values, label in (
        ("throughput.png", [s.tps_per_device or 0.0 for s in summaries], "tokens/s per device (steady state)"),
        (
            "memory.png",
            [s.peak_memory_gib or 0.0 for s in summaries],
            "peak memory GiB (" + ", ".join(sorted({s.memory_kind for s in summaries if s.memory_kind})) + ")",
        ),
    ):
        figure, axis = plt.subplots(figsize=(8, 0.5 * len(summaries) + 1.5))
        axis.barh(range(len(summaries)), values)
        axis.set_yticks(range(len(summaries)), [f"{n} ({s.run_id[:8]})" for n, s in zip(names, summaries)], fontsize=7)
        axis.invert_yaxis()
        axis.set(xlabel=label, title=label.split(" (")[0] + " per strategy")
        save(figure, name)

    save(_scaling_plot(plt, summaries), "scaling.png")
    return paths


def _scaling_plot(plt, summaries: list[RunSummary]):
    """TPS/device against world size, one line per family of runs that differ in scale only."""
    figure, axis = plt.subplots(figsize=(8, 5))
    families: dict[tuple, list[RunSummary]] = {}
    for s in summaries:
        if s.scaling_efficiency is not None:
            families.setdefault(s.family, []).append(s)
    for (model, strategy, quantize, (tp, pp, cp), device, tokens), members in families.items():
        members.sort(key=lambda s: s.world_size)
        label = (
            f"{model} {strategy}"
            + (f" {quantize}" if quantize != "none" else "")
            + f" tp{tp} pp{pp} cp{cp} {device} {tokens} tok/rank"
        )
        axis.plot([s.world_size for s in members], [s.scaling_efficiency for s in members], marker="o", label=label)
    axis.axhline(1.0, linestyle="--", color="grey", linewidth=1)
    axis.set(
        xlabel="world size (devices)",
        ylabel="TPS/device ÷ that of the family's smallest world size",
        title="Scaling efficiency",
    )
    if families:
        axis.legend(fontsize=7)
    return figure


@dataclass
class Report:
    summaries: list[RunSummary]
    markdown: str
    files: list[Path]


def write_report(summaries: list[RunSummary], out_dir: Path, title: str) -> Report:
    """Table in three formats and the plots, under out_dir."""
    add_scaling_efficiency(summaries)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = table(summaries)
    markdown = to_markdown(rows)
    (out_dir / "strategy_table.md").write_text(f"# {title}\n\n{markdown}")
    (out_dir / "strategy_table.html").write_text(to_html(rows, title))
    write_csv(summaries, out_dir / "strategy_table.csv")
    files = [out_dir / f"strategy_table.{ext}" for ext in ("md", "csv", "html")] + write_plots(summaries, out_dir)
    return Report(summaries, markdown, files)


def compare_sweep(uri: str, parent_run_id: str, out_dir: Path) -> Report:
    """Compare a sweep's points and log the table and plots to its parent run under compare/."""
    client = mlflow_client(uri)
    parent = client.get_run(parent_run_id)
    summaries = [summarize(client, run) for run in sweep_points(client, parent)]
    report = write_report(summaries, out_dir, f"Strategy comparison: {parent.info.run_name}")
    parent_run = MlflowRun(uri, parent_run_id)
    for path in report.files:
        parent_run.log_artifact(path, "compare")
    return report

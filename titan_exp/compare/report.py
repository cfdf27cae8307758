"""The strategy table (Markdown, CSV, HTML) and plots (PNG) over a set of runs, and the comparison of
a sweep written into its parent run."""

import csv
import html
from dataclasses import dataclass
from pathlib import Path

from titan_exp.compare import plots
from titan_exp.compare.runs import (
    MIN_INTERVALS,
    RunSummary,
    add_scaling_efficiency,
    add_tps_groups,
    best_first,
    families,
    summarize,
    sweep_points,
    varying_params,
)
from titan_exp.tracking.run import SWEEP_OVERRIDES_PARAM, MlflowRun
from titan_exp.tracking.store import client as mlflow_client

EXPERT_LOAD_COLUMN = "experts max/mean"
COLUMNS = [
    "strategy",
    "world size",
    "global batch",
    "tokens/step",
    "accumulation",
    "TPS/device",
    "TPS/device median (IQR)",
    "TPS group",
    "predicted TPS/device",
    "MFU %",
    "peak memory GiB",
    "predicted peak GiB",
    "scaling efficiency",
    "final loss",
    "validation loss",
    "status",
    "run",
]
OVERSUBSCRIBED = "oversubscribed"
NOT_READ = "–"  # a key the run's layout does not read (a schedule without a pipeline)
OVERSUBSCRIBED_NOTE = (
    f"{OVERSUBSCRIBED}: the run's CPU rank threads outnumbered its cores; its throughput measures "
    "time-sharing, not the layout."
)
SPREAD_NOTE = (
    "TPS/device median (IQR): the median and interquartile range of TPS/device over the n log intervals "
    f"that TPS/device covers (blank with fewer than {MIN_INTERVALS}). TPS group: runs that share a letter have "
    "overlapping interquartile ranges, so the difference between their TPS/device lies within the spread "
    "from interval to interval and their order is not established; runs with no letter in common differ."
)
# What records the predictions a table lacks, where the runs' overrides are not at hand (`compare --all`).
PLAN_ANY_RUN = "`titan_exp plan` with the run's overrides (its artifact config/hydra/overrides.yaml)"
SCALING_NOTE = (
    "scaling efficiency: TPS/device over that of the smallest data-parallel size among runs that differ "
    "in nothing else; blank where there is no such run."
)


def columns(varying: list[str], moe: bool = False) -> list[str]:
    """The table's columns: the run's name, each config key that differs between the runs, the
    figures (the experts' load where a run has experts)."""
    figures = COLUMNS[1:]
    if moe:  # beside the memory: what expert parallelism trades against
        at = figures.index("scaling efficiency")
        figures = [*figures[:at], EXPERT_LOAD_COLUMN, *figures[at:]]
    return COLUMNS[:1] + varying + figures


def has_experts(summaries: list[RunSummary]) -> bool:
    return any(s.expert_load_imbalance is not None for s in summaries)


def table(summaries: list[RunSummary], varying: list[str] = ()) -> list[list[str]]:
    """One row of text per run, in columns(varying) order."""

    def number(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    def predicted(value: float | None, measured: float | None, fmt: str) -> str:
        """The prediction and how far it was from the measured figure (where they are comparable)."""
        if value is None:
            return "n/a"
        error = f" ({100 * (value / measured - 1):+.0f}%)" if measured else ""
        return format(value, fmt) + error

    rows, moe = [], has_experts(summaries)
    for s in summaries:
        memory = f"{number(s.peak_memory_gib, '.2f')} ({s.memory_kind})" if s.peak_memory_gib is not None else "n/a"
        status = s.status if not s.failure_reason else f"{s.status}: {s.failure_reason[:80]}"
        tps = number(s.tps_per_device, ",.0f") + (f" ({OVERSUBSCRIBED})" if s.oversubscribed else "")
        spread = ""
        if s.tps_quartiles:
            q1, median, q3 = s.tps_quartiles
            spread = f"{median:,.0f} ({q1:,.0f}–{q3:,.0f}, n={len(s.steady_tps)})"
        rows.append(
            [
                s.name,
                *(s.params.get(key, "") if s.reads(key) else NOT_READ for key in varying),
                str(s.world_size),
                *s.batch,
                tps,
                spread,
                s.tps_group,
                predicted(s.predicted_tps_per_device, s.tps_per_device, ",.0f"),
                number(s.mfu_pct, ".2f"),
                memory,
                # Predictions count tensors: comparable with an allocator's peak, not a CPU resident set.
                predicted(s.predicted_peak_memory_gib, s.peak_memory_gib if s.memory_kind == "active" else None, ".2f"),
                *([number(s.expert_load_imbalance, ".2f")] if moe else []),
                "" if s.scaling_efficiency is None else format(s.scaling_efficiency, ".2f"),
                number(s.final_loss, ".4f"),
                "" if s.validation_loss is None else format(s.validation_loss, ".4f"),
                status,
                s.run_id[:8],
            ]
        )
    return rows


EXPERT_LOAD_NOTE = (
    f"{EXPERT_LOAD_COLUMN}: at the last logged step, the worst MoE layer's busiest expert over the mean "
    "expert's tokens; a run's expert_load.png sums the tokens over the whole run, where one step's busy "
    "experts are another's idle ones, so its per-layer figures are lower."
)


def notes(summaries: list[RunSummary], varying: list[str], plan_command: str = PLAN_ANY_RUN) -> list[str]:
    """What a reader needs to read the table right: the lines under it (`plan_command`: what
    records the predictions of the runs' layouts)."""
    lines = [SPREAD_NOTE] if any(s.tps_quartiles for s in summaries) else []
    if any(s.predicted_tps_per_device is None for s in summaries):
        lines.append(
            "n/a in predicted TPS/device and predicted peak GiB: the experiment holds no prediction of the "
            f"run's layout; {plan_command} records one."
        )
    if any(s.scaling_efficiency is not None for s in summaries):
        lines.append(SCALING_NOTE)
    if has_experts(summaries):
        lines.append(EXPERT_LOAD_NOTE)
    if any(not s.reads(key) for s in summaries for key in varying):
        lines.append(f"{NOT_READ}: a key the run's layout does not read.")
    if any(s.oversubscribed for s in summaries):
        lines.append(OVERSUBSCRIBED_NOTE)
    return lines


def to_markdown(rows: list[list[str]], columns: list[str] = COLUMNS) -> str:
    escape = lambda cell: cell.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(escape(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def to_html(rows: list[list[str]], title: str, columns: list[str] = COLUMNS, notes: list[str] = ()) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>\n" for row in rows)
    after = "".join(f"<p>{html.escape(note)}</p>\n" for note in notes)
    return (
        f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>table{border-collapse:collapse;font-family:sans-serif}"
        "td,th{border:1px solid #999;padding:4px 8px;text-align:right}td:first-child{text-align:left}</style></head>\n"
        f"<body><h1>{html.escape(title)}</h1>\n<table><tr>{head}</tr>\n{body}</table>\n{after}</body></html>\n"
    )


# The CSV carries plain numbers (no separators, full precision) for spreadsheets and pandas.
CSV_COLUMNS = [
    "strategy",
    "world_size",
    "global_batch",
    "tokens_per_step",
    "accumulation",
    "tps_per_device",
    "tps_per_device_q1",
    "tps_per_device_median",
    "tps_per_device_q3",
    "steady_intervals",
    "tps_group",
    "oversubscribed",
    "predicted_tps_per_device",
    "mfu_pct",
    "peak_memory_gib",
    "memory_kind",
    "predicted_peak_memory_gib",
    "expert_load_imbalance",
    "scaling_efficiency",
    "final_loss",
    "validation_loss",
    "status",
    "failure_reason",
    "run_id",
]


def write_csv(summaries: list[RunSummary], path: Path, varying: list[str] = ()) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(CSV_COLUMNS[:1] + list(varying) + CSV_COLUMNS[1:])
        for s in summaries:
            writer.writerow(
                [
                    s.name,
                    # Empty where the run's layout does not read the key, as the tables' dash.
                    *(s.params.get(key, "") if s.reads(key) else "" for key in varying),
                    s.world_size,
                    *(value.replace(",", "") for value in s.batch),
                    s.tps_per_device,
                    *(s.tps_quartiles or ("", "", "")),
                    len(s.steady_tps),
                    s.tps_group,
                    s.oversubscribed,
                    s.predicted_tps_per_device,
                    s.mfu_pct,
                    s.peak_memory_gib,
                    s.memory_kind,
                    s.predicted_peak_memory_gib,
                    s.expert_load_imbalance,
                    s.scaling_efficiency,
                    s.final_loss,
                    s.validation_loss,
                    s.status,
                    s.failure_reason,
                    s.run_id,
                ]
            )


def write_plots(summaries: list[RunSummary], out_dir: Path) -> list[Path]:
    """loss_curves.png, throughput.png, memory.png, and scaling.png where there is scaling."""
    labels = [f"{s.name} ({s.run_id[:8]}{', ' + OVERSUBSCRIBED if s.oversubscribed else ''})" for s in summaries]
    paths = [out_dir / name for name in ("loss_curves.png", "throughput.png", "memory.png")]
    plots.overlay(
        {label: s.loss_curve for label, s in zip(labels, summaries)}, paths[0], "Loss curves", "loss (global average)"
    )
    plots.bars(labels, [s.tps_per_device or 0.0 for s in summaries], paths[1], "tokens/s per device (steady state)")
    kinds = ", ".join(sorted({s.memory_kind for s in summaries if s.memory_kind}))
    plots.bars(labels, [s.peak_memory_gib or 0.0 for s in summaries], paths[2], f"peak memory GiB ({kinds})")
    scaled = families([s for s in summaries if s.scaling_efficiency is not None])
    if scaled:
        paths.append(out_dir / "scaling.png")
        plots.scaling({_family_label(members): members for members in scaled}, paths[-1])
    return paths


def _family_label(members: list[RunSummary]) -> str:
    """A family by the names of its runs, smallest data-parallel size first (fsdp's and ddp's
    single-device runs share a name, not a family, so the run id of the first is added)."""
    ordered = sorted(members, key=lambda s: s.data_parallel_size)
    return " → ".join(dict.fromkeys(s.name for s in ordered)) + f" ({ordered[0].run_id[:8]}…)"


@dataclass
class Report:
    summaries: list[RunSummary]
    markdown: str
    files: list[Path]


def write_report(summaries: list[RunSummary], out_dir: Path, title: str, plan_command: str = PLAN_ANY_RUN) -> Report:
    """The table (best first, a column for each config key that differs) in three formats, and the
    plots, under out_dir; `plan_command` records the predictions it lacks."""
    add_scaling_efficiency(summaries)
    summaries = best_first(summaries)
    add_tps_groups(summaries)
    varying = varying_params(summaries)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = table(summaries, varying)
    header = columns(varying, has_experts(summaries))
    below = notes(summaries, varying, plan_command)
    markdown = to_markdown(rows, header) + "".join(f"\n{note}\n" for note in below)
    (out_dir / "strategy_table.md").write_text(f"# {title}\n\n{markdown}")
    (out_dir / "strategy_table.html").write_text(to_html(rows, title, header, below))
    write_csv(summaries, out_dir / "strategy_table.csv", varying)
    files = [out_dir / f"strategy_table.{ext}" for ext in ("md", "csv", "html")] + write_plots(summaries, out_dir)
    return Report(summaries, markdown, files)


def compare_sweep(uri: str, parent_run_id: str, out_dir: Path) -> Report:
    """Compare a sweep's points and log the table and plots to its parent run under compare/."""
    client = mlflow_client(uri)
    parent = client.get_run(parent_run_id)
    summaries = [summarize(client, run) for run in sweep_points(client, parent)]
    swept = parent.data.params.get(SWEEP_OVERRIDES_PARAM)
    plan_command = f"`titan_exp plan {swept}`" if swept else PLAN_ANY_RUN
    report = write_report(summaries, out_dir, f"Strategy comparison: {parent.info.run_name}", plan_command)
    parent_run = MlflowRun(uri, parent_run_id)
    for path in report.files:
        parent_run.log_artifact(path, "compare")
    return report

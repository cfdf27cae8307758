"""The comparison plots (PNG): loss curves overlaid, a bar per run, scaling efficiency. Long run names
go in legends under the axes and as bar labels, never over the data; steps and world sizes are whole
numbers on their axes."""

from pathlib import Path

from titan_exp.compare.runs import RunSummary
from titan_exp.pyplot import pyplot


def _save(plt, figure, path: Path, legend: bool) -> None:
    """Written and closed; a legend goes under the axes, where long run names hide no data, in two
    columns, and the saved image is cut to what was drawn (nothing of the legend outside it)."""
    if legend:
        entries = len(figure.axes[0].get_legend_handles_labels()[1])
        figure.legend(loc="outside lower center", fontsize=7, frameon=False, ncols=min(2, max(1, entries)))
    figure.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.1)
    plt.close(figure)


def _legend_rows(entries: int) -> float:
    """Inches the legend takes under the axes (two entries a row), so the axes keep their height."""
    return 0.17 * ((entries + 1) // 2)


def _draw_curves(axis, curves: dict[str, list[tuple[int, float]]], labels: dict[str, str] | None = None) -> None:
    """Curves that lie on one another stay visible: each is drawn thinner than the one before, in
    a dash pattern of its own, its markers at steps of its own."""
    drawn = {label: curve for label, curve in curves.items() if curve}
    count = len(drawn)
    for n, (label, curve) in enumerate(drawn.items()):
        steps, values = zip(*curve)
        every = max(1, len(steps) // 8)
        axis.plot(
            steps,
            values,
            color=f"C{n % 10}",
            linewidth=3.0 - 2.2 * n / max(count - 1, 1),
            linestyle=("-", "--", "-.", ":")[n % 4],
            marker="os^Dv<>p"[n % 8],
            ms=4,
            markevery=(n * every // max(count, 1) % every, every),
            label=(labels or {}).get(label, label),
        )


def overlay(curves: dict[str, list[tuple[int, float]]], path: Path, title: str, ylabel: str) -> None:
    """Curves of (step, value) in one axes, whole steps on x, the legend under the axes."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    figure, axis = plt.subplots(figsize=(9, 4.5 + _legend_rows(len(curves))), layout="constrained")
    _draw_curves(axis, curves)
    axis.set(xlabel="step", ylabel=ylabel, title=title)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.grid(alpha=0.3)
    _save(plt, figure, path, legend=any(curves.values()))


def parity(curves: dict[str, list[float]], rtol: float, path: Path, title: str) -> None:
    """Loss parity: the curves above; below, what parity is about, each layout's relative deviation
    from the first (the reference) step by step, inside the band ±rtol the check allows."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 7 + _legend_rows(len(curves))), sharex=True, layout="constrained", height_ratios=(1, 1.2)
    )
    reference_name, reference = next(iter(curves.items()))
    steps = {name: list(enumerate(curve, start=1)) for name, curve in curves.items()}
    deviations = {
        name: [(step, value / reference[step - 1] - 1) for step, value in points if step <= len(reference)]
        for name, points in steps.items()
    }
    worst = {name: max((abs(d) for _, d in points), default=0.0) for name, points in deviations.items()}
    labels = {name: f"{name} (max deviation {worst[name]:.1e})" for name in curves}
    labels[reference_name] = f"{reference_name} (the reference)"
    _draw_curves(top, steps, labels)
    top.set(ylabel="loss (global average)", title=title)
    top.grid(alpha=0.3)
    bottom.axhspan(-rtol, rtol, color="green", alpha=0.12, label=f"tolerance ±{rtol:g}")
    _draw_curves(bottom, deviations, {name: f"_{name}" for name in deviations})  # named once, above
    bottom.axhline(0.0, color="grey", linewidth=0.8)
    limit = max(rtol, *worst.values()) * 1.3
    bottom.set(xlabel="step", ylabel=f"loss / {reference_name}'s − 1", ylim=(-limit, limit))
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.grid(alpha=0.3)
    _save(plt, figure, path, legend=True)


def bars(labels: list[str], values: list[float], path: Path, xlabel: str) -> None:
    """One horizontal bar per run, labelled with its name, in the table's order."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(9, 0.4 * len(labels) + 1.5), layout="constrained")
    axis.barh(range(len(labels)), values)
    axis.set_yticks(range(len(labels)), labels, fontsize=7)
    axis.invert_yaxis()
    axis.set(xlabel=xlabel, title=xlabel.split(" (")[0] + " per run")
    _save(plt, figure, path, legend=False)


def scaling(families: dict[str, list[RunSummary]], path: Path) -> None:
    """Scaling efficiency against world size, one line per family; only the world sizes run are ticks."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(9, 4.5 + _legend_rows(len(families))), layout="constrained")
    sizes = set()
    for label, members in families.items():
        members = sorted(members, key=lambda s: s.world_size)
        sizes.update(s.world_size for s in members)
        axis.plot([s.world_size for s in members], [s.scaling_efficiency for s in members], marker="o", label=label)
    axis.axhline(1.0, linestyle="--", color="grey", linewidth=1)
    axis.set_xticks(sorted(sizes))
    axis.set(
        xlabel="world size (devices)",
        ylabel="TPS/device ÷ at the smallest data-parallel size",
        title="Scaling efficiency",
    )
    axis.grid(alpha=0.3)
    _save(plt, figure, path, legend=True)

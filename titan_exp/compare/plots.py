"""The comparison plots (PNG): loss curves overlaid, a bar per run, scaling efficiency. Long run names
go in legends under the axes and as bar labels, never over the data; steps and world sizes are whole
numbers on their axes."""

from pathlib import Path

from titan_exp.compare.runs import RunSummary


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, figure, path: Path, legend: bool) -> None:
    """Written and closed; a legend goes under the axes, where long run names hide no data."""
    if legend:
        figure.legend(loc="outside lower center", fontsize=7, frameon=False)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def overlay(curves: dict[str, list[tuple[int, float]]], path: Path, title: str, ylabel: str) -> None:
    """Curves of (step, value) in one axes, whole steps on x, the legend under the axes."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    # The figure grows with the legend (a line per curve) so the axes keep their height.
    figure, axis = plt.subplots(figsize=(9, 4.5 + 0.17 * len(curves)), layout="constrained")
    drawn = {label: curve for label, curve in curves.items() if curve}
    for n, (label, curve) in enumerate(drawn.items()):
        steps, values = zip(*curve)
        # Past ten curves the colours repeat: a marker of its own tells them apart.
        axis.plot(steps, values, color=f"C{n % 10}", marker="os^D"[n // 10 % 4], ms=3, label=label)
    axis.set(xlabel="step", ylabel=ylabel, title=title)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.grid(alpha=0.3)
    _save(plt, figure, path, legend=bool(drawn))


def bars(labels: list[str], values: list[float], path: Path, xlabel: str) -> None:
    """One horizontal bar per run, labelled with its name, in the table's order."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(9, 0.4 * len(labels) + 1.5), layout="constrained")
    axis.barh(range(len(labels)), values)
    axis.set_yticks(range(len(labels)), labels, fontsize=7)
    axis.invert_yaxis()
    axis.set(xlabel=xlabel, title=xlabel.split(" (")[0] + " per run")
    _save(plt, figure, path, legend=False)


def scaling(families: dict[str, list[RunSummary]], path: Path) -> None:
    """Scaling efficiency against world size, one line per family; only the world sizes run are ticks."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(9, 4.5 + 0.17 * len(families)), layout="constrained")
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

"""A memory audit as a person reads it: one self-contained HTML page (the plot is an embedded PNG,
no script, nothing fetched) with memory over the audited step by category, the peak's breakdown,
and the per-module table. It opens offline in the MLflow UI's artifact view."""

import base64
import html
import io
from dataclasses import dataclass

from titan_exp.pyplot import pyplot
from titan_exp.units import GIB, MIB

# torch's MemTracker categories (_MemRefType), in the order they are stacked, and their colors.
CATEGORIES = {
    "PARAM": ("parameters", "darkgreen"),
    "BUFFER": ("buffers", "olive"),
    "OPT": ("optimizer state", "goldenrod"),
    "GRAD": ("gradients", "mediumblue"),
    "ACT": ("activations", "red"),
    "TEMP": ("temporaries", "mediumpurple"),
    "OTH": ("other", "grey"),
}


@dataclass(frozen=True)
class ModuleRow:
    module: str
    parameters: int
    outputs: int
    forward_peak: int
    backward_peak: int


@dataclass(frozen=True)
class MemoryAudit:
    step: int
    rank: int
    times_ms: list[float]  # from the step's start
    by_category: dict[str, list[int]]  # bytes over the step, per category name
    peak_index: int
    modules: list[ModuleRow]
    tracked_peak: int  # MemTracker's own peak over the step, bytes

    @classmethod
    def from_timeline(
        cls, step: int, rank: int, timeline: list[tuple[float, dict[str, int]]], modules: list, tracked_peak: int
    ) -> "MemoryAudit":
        """`timeline`: (seconds, {MemTracker category: bytes}) after every allocation and free."""
        start = timeline[0][0] if timeline else 0.0
        by_category = {name: [snap.get(key, 0) for _, snap in timeline] for key, (name, _) in CATEGORIES.items()}
        totals = [sum(sizes[i] for sizes in by_category.values()) for i in range(len(timeline))]
        peak = max(range(len(totals)), key=totals.__getitem__) if totals else 0
        times_ms = [(t - start) * 1000 for t, _ in timeline]
        return cls(step, rank, times_ms, by_category, peak, modules, tracked_peak)

    @property
    def peak_breakdown(self) -> dict[str, int]:
        return {name: sizes[self.peak_index] for name, sizes in self.by_category.items() if sizes}

    @property
    def peak(self) -> int:
        return sum(self.peak_breakdown.values())

    def metrics(self) -> dict[str, float]:
        """The peak's breakdown as metrics (memory/audit_*), to compare runs on."""
        found = {f"memory/audit_{name.replace(' ', '_')}_gib": size / GIB for name, size in self.peak_breakdown.items()}
        tracked = {"memory/audit_memtracker_peak_gib": self.tracked_peak / GIB}
        return {"memory/audit_peak_gib": self.peak / GIB, **tracked, **found}


def write_audit_html(audit: MemoryAudit, path) -> None:
    breakdown = "".join(
        f"<tr><td>{name}</td><td>{size / MIB:,.1f}</td><td>{100 * size / max(audit.peak, 1):.1f}%</td></tr>"
        for name, size in sorted(audit.peak_breakdown.items(), key=lambda item: -item[1])
        if size
    )
    modules = "".join(
        f"<tr><td>{html.escape(row.module)}</td><td>{row.parameters / MIB:,.1f}</td><td>{row.outputs / MIB:,.1f}</td>"
        f"<td>{row.forward_peak / MIB:,.1f}</td><td>{row.backward_peak / MIB:,.1f}</td></tr>"
        for row in audit.modules
    )
    title = f"Memory of step {audit.step}, rank {audit.rank}"
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:1.5em}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} td:first-child,th:first-child{{text-align:left}}</style>
</head><body>
<h1>{title}</h1>
<p>Peak {audit.peak / MIB:,.1f} MiB of tensors on this rank (torch's MemTracker, which saw every
allocation and free of the step; its own peak: {audit.tracked_peak / MIB:,.1f} MiB).</p>
<img alt="memory over the step by category" src="data:image/png;base64,{_timeline_png(audit)}">
<h2>At the peak</h2>
<table><tr><th>category</th><th>MiB</th><th>share</th></tr>{breakdown}</table>
<h2>Per module (MemTracker)</h2>
<table><tr><th>module</th><th>parameters MiB</th><th>outputs MiB</th><th>peak in forward MiB</th>
<th>peak in backward MiB</th></tr>{modules}</table>
</body></html>
"""
    path.write_text(page, encoding="utf-8")


def _timeline_png(audit: MemoryAudit) -> str:
    plt = pyplot()
    colors = dict(CATEGORIES.values())
    names = [name for name, sizes in audit.by_category.items() if any(sizes)]
    figure, axes = plt.subplots(figsize=(10, 4.5), dpi=100, layout="constrained")
    stacked = [[size / MIB for size in audit.by_category[name]] for name in names]
    axes.stackplot(audit.times_ms, *stacked, labels=names, colors=[colors[name] for name in names])
    if audit.times_ms:
        axes.axvline(audit.times_ms[audit.peak_index], color="black", linestyle=":", linewidth=1)
    axes.set_xlabel("ms into the step")
    axes.set_ylabel("MiB")
    axes.set_title(f"step {audit.step}, rank {audit.rank}: memory by category (peak {audit.peak / MIB:,.1f} MiB)")
    figure.legend(loc="outside right upper", fontsize=8, frameon=False)  # beside the areas, over none
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()

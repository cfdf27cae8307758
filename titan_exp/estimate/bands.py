"""How far a prediction is to be trusted: a band around its TPS and its peak memory (torch-free).

The band is what the planner's errors on published runs of that hardware were: the 80th
percentile of |predicted − published| / published over the runs of the profile
(`benchmarks/bench_planner_published.py --bands` writes them to validation_bands.json, naming the
benchmark and its date), so that about four in five runs like them land inside. A profile with
fewer than MIN_RUNS published runs, or none (a guess copied from another device, a user's own
profile), takes the 80th percentile over every published run, widened by UNVALIDATED_WIDENING:
nothing says it does better. A profile whose kernels were measured by `plan probe` has its own
machine's figures, but no published run of that machine checks the layout side on it: the pooled band.

No figure of a prediction comes from here: the runs validate the planner, the band says how well.
"""

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

BANDS_FILE = Path(__file__).with_name("validation_bands.json")
MIN_RUNS = 5
UNVALIDATED_WIDENING = 1.5
QUANTILE = 0.8


@dataclass(frozen=True)
class Band:
    """± `pct` percent around a figure, and what it rests on (one line)."""

    pct: float
    basis: str

    def around(self, value: float) -> tuple[float, float]:
        return value * (1 - self.pct / 100), value * (1 + self.pct / 100)


@cache
def _bands() -> dict:
    return json.loads(BANDS_FILE.read_text())


def band(hardware: str, figure: str) -> Band:
    """The band of `figure` (tps or memory) for a prediction on profile `hardware`."""
    table = _bands()
    own = table[figure]["by_profile"].get(hardware)
    if own is not None and own["runs"] >= MIN_RUNS:
        return Band(own["band_pct"], f"{hardware}'s {own['runs']} published runs ({table['source']})")
    pooled = table[figure]["pooled"]
    widened = pooled["band_pct"] * UNVALIDATED_WIDENING
    runs = own["runs"] if own else 0
    return Band(
        widened,
        f"{runs} published run(s) of {hardware}: every profile's {pooled['runs']} runs' band × {UNVALIDATED_WIDENING}",
    )


def quantile_band(errors_pct: list[float]) -> float:
    """The QUANTILE-th of |errors| (linear between ranks), what bands are made of."""
    ordered = sorted(abs(e) for e in errors_pct)
    where = QUANTILE * (len(ordered) - 1)
    low = int(where)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (where - low) * (ordered[high] - ordered[low])


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two bands share any value: their difference lies inside what the planner can tell."""
    return a[0] <= b[1] and b[0] <= a[1]

"""estimate/bands.py: a prediction's band from the planner's errors on that hardware's published
runs, or, with too few, every run's widened; and the plan's "run both" marks where bands overlap."""

import json

import pytest

from titan_exp.estimate.bands import BANDS_FILE, MIN_RUNS, UNVALIDATED_WIDENING, Band, band, overlap, quantile_band
from titan_exp.plan import cli as plan_cli
from titan_exp.plan.predict import Prediction


def test_the_80th_percentile_of_the_absolute_errors() -> None:
    assert quantile_band([-10.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 50.0]) == pytest.approx(9.0)
    assert quantile_band([-30.0]) == 30.0


def test_a_validated_profile_takes_its_own_band_and_others_every_runs_widened() -> None:
    table = json.loads(BANDS_FILE.read_text())
    validated = [name for name, own in table["tps"]["by_profile"].items() if own["runs"] >= MIN_RUNS]
    assert validated, table
    own = band(validated[0], "tps")
    assert own.pct == table["tps"]["by_profile"][validated[0]]["band_pct"] and validated[0] in own.basis
    guessed = band("gb200", "tps")  # no published run: copied figures
    assert guessed.pct == pytest.approx(table["tps"]["pooled"]["band_pct"] * UNVALIDATED_WIDENING)
    assert "0 published run(s) of gb200" in guessed.basis
    assert Band(10.0, "").around(100.0) == pytest.approx((90.0, 110.0))


def _prediction(tps: float, fits: bool = True) -> Prediction:
    """A prediction with only what the marks read: its TPS, whether it fits, a ±10% band."""
    return Prediction(
        layout="x", mesh="x", world_size=1, memory=None, memory_budget_gib=1e9 if fits else -1.0,
        step=None, tps_per_device=tps, mfu_pct=0.0, sources={}, tps_band=Band(10.0, "test"),
    )  # fmt: skip


def test_run_both_marks_the_fitting_layouts_the_bands_cannot_tell_from_the_best(monkeypatch) -> None:
    monkeypatch.setattr(Prediction, "peak_gib", property(lambda self: 0.0))
    ranked = [_prediction(1000), _prediction(850), _prediction(700), _prediction(950, fits=False)]
    # 1000 ± 10% and 850 ± 10% overlap (900–1100, 765–935); 700 ± 10% does not; a misfit is never marked.
    assert plan_cli._run_both(ranked) == ["", "with #1", "", ""]
    assert overlap((1, 2), (2, 3)) and not overlap((1, 2), (2.1, 3))

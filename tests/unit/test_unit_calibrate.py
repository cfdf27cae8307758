"""titan_exp/plan/calibrate.py: a profile's figures fitted to runs come back to the figures that
made those runs, within the bounds, and a figure no run exercises keeps its value."""

import dataclasses

import pytest

from titan_exp.plan.calibrate import GPU_FIGURES, Observation, fit, tps_error_pct
from titan_exp.plan.point import compose_point

H100 = ["hardware=h100", "plan.measure=false", "tracking=none", "training.mixed_precision_param=bfloat16"]
# Layouts whose steps lean on different kernels: matmuls, long-sequence attention, eager
# elementwise work (bandwidth), and TP's collectives.
LAYOUTS = [
    ["model=llama3_8b", "parallelism=fsdp", "launcher.nproc_per_node=8", "training.seq_len=2048"],
    ["model=llama3_8b", "parallelism=fsdp", "launcher.nproc_per_node=8", "training.seq_len=32768"],
    ["model=llama3_8b", "parallelism=fsdp", "launcher.nproc_per_node=8", "compile.enable=true"],
    ["model=llama3_8b", "parallelism=fsdp_tp", "parallelism.tensor_parallel_degree=2", "launcher.nproc_per_node=8"],
]


@pytest.fixture(scope="module")
def jobs():
    return [compose_point([*H100, *layout]) for layout in LAYOUTS]


def observed(jobs, **truth: float) -> list[Observation]:
    """The runs as a device whose kernels reach `truth` would have measured them."""
    hw = jobs[0].config.hardware
    made = [Observation(f"run{i}", job, hw, tps=1.0) for i, job in enumerate(jobs)]
    return [dataclasses.replace(o, tps=o.predicted_tps(truth)) for o in made]


def test_a_fit_finds_the_figures_that_made_the_runs(jobs) -> None:
    runs = observed(jobs, matmul_efficiency=0.4, attention_efficiency=0.5)
    assert tps_error_pct(runs) > 10  # the profile's own figures (0.56, 0.3) are off
    figures = fit(runs, GPU_FIGURES, runs[0].hw)
    assert figures["matmul_efficiency"] == pytest.approx(0.4, rel=0.02)
    assert figures["attention_efficiency"] == pytest.approx(0.5, rel=0.05)
    assert tps_error_pct(runs, figures) < 0.5
    # bf16 runs say nothing of float8's matmuls: that figure is the profile's.
    assert figures["float8_matmul_efficiency"] == runs[0].hw.float8_matmul_efficiency


def test_a_fit_stays_within_the_bounds(jobs) -> None:
    """Runs slower than any kernel would make them: the efficiency stops at its floor."""
    runs = [dataclasses.replace(o, tps=o.tps / 20) for o in observed(jobs)]
    figures = fit(runs, GPU_FIGURES, runs[0].hw)
    low, _ = GPU_FIGURES["matmul_efficiency"]
    assert figures["matmul_efficiency"] == pytest.approx(low, rel=1e-3)


def test_nothing_to_fit_is_refused(jobs) -> None:
    with pytest.raises(ValueError, match="no runs"):
        fit([], GPU_FIGURES, jobs[0].config.hardware)

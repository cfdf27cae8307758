"""titan_exp/metrics/format.py: the console line of a logged step and the name=value summary."""

import pytest

from titan_exp.metrics.format import format_line, format_summary

METRICS = {
    "loss/global_avg": 2.5,
    "grad_norm": 0.125,
    "lr": 3e-4,
    "throughput/tps_per_device": 12345.6,
    "throughput/tflops": 1.2346,
    "throughput/mfu_pct": 12.3456,
    "memory/max_active_gib": 1.5,
    "time/step_s": 0.25,
    "time/data_loading_pct": 2.5,
}


def test_cuda_line() -> None:
    """Where the run stands (step N of all) first, the time left last."""
    assert format_line(7, 50, METRICS, "~11 s left") == (
        "step     7/50  loss  2.5000  grad_norm  0.1250  lr 3.00e-04  tps/dev 12,346  tflops 1.235  mfu 12.35%  "
        "mem(active) 1.50GiB  step 0.250s  data 2.5%  ~11 s left"
    )


def test_cpu_line_without_mfu() -> None:
    """No allocator peak: the resident-set peak; no peak FLOP/s: mfu n/a."""
    cpu = {k: v for k, v in METRICS.items() if k not in ("memory/max_active_gib", "throughput/mfu_pct")}
    line = format_line(12345, 12345, cpu | {"memory/cpu_rss_peak_gib": 0.456}, "")
    assert line.startswith("step 12345/12345  ")
    assert "mfu n/a  mem(cpu rss peak) 0.46GiB  " in line and line.endswith("data 2.5%")


def test_a_line_needs_some_memory_figure() -> None:
    without_memory = {k: v for k, v in METRICS.items() if k != "memory/max_active_gib"}
    with pytest.raises(KeyError, match="memory/cpu_rss_peak_gib"):
        format_line(1, 1, without_memory, "")


def test_summary_strips_groups_and_formats_numbers() -> None:
    """Integers with thousands separators, floats to 4 significant digits, the rest as str."""
    summary = format_summary(
        {
            "derived/num_params": 5_573_888,
            "derived/mesh": "dp_shard2",
            "derived/peak_flops_per_device": 1.5e14,
            "a/b/ratio": 0.000123456,
            "big": 12345.678,
            "derived/peak": None,
        }
    )
    assert summary == (
        "num_params=5,573,888  mesh=dp_shard2  peak_flops_per_device=1.5e+14  ratio=0.0001235  big=1.235e+04  peak=None"
    )

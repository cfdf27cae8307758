"""titan_exp/metrics/throughput.py: tokens/s per device, TFLOPs, MFU and timing of each log interval,
and the steady-state means from the second interval on, driven by a fake clock on the CPU."""

from types import SimpleNamespace

import pytest
import torch

from titan_exp.metrics import throughput
from titan_exp.metrics.throughput import ThroughputMeter


class FakeMemory:
    """Stands in for MemoryMonitor (which resets the process's VmHWM): a fixed peak."""

    def __init__(self, device: torch.device) -> None:
        self.resets = 0

    def reset_peak(self) -> None:
        self.resets += 1

    def peak(self) -> dict[str, float]:
        return {"memory/cpu_rss_peak_gib": 1.25}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """`clock.now` is what time.perf_counter returns inside the meter."""
    now = SimpleNamespace(now=0.0)
    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=lambda: now.now))
    monkeypatch.setattr(throughput, "MemoryMonitor", FakeMemory)
    return now


FLOPS_PER_TOKEN = 1_000_000
PEAK = 1e12


def test_intervals_and_steady_state_means(clock: SimpleNamespace) -> None:
    """2 ranks of model parallelism (non-data-parallel size 2) share each token."""
    meter = ThroughputMeter(FLOPS_PER_TOKEN, PEAK, non_data_parallel_size=2, device=torch.device("cpu"))
    # Interval 1: 0 → 2 s, two steps of 1000 tokens, 0.5 s loading data: 2000 / (2 s · 2) = 500.
    meter.add_step(1000, 0.2)
    meter.add_step(1000, 0.3)
    clock.now = 2.0
    first = meter.collect()
    assert first["throughput/tps_per_device"] == 500
    assert first["throughput/tflops"] == pytest.approx(FLOPS_PER_TOKEN * 500 / 1e12)
    assert first["throughput/mfu_pct"] == pytest.approx(100 * FLOPS_PER_TOKEN * 500 / PEAK)
    assert first["time/step_s"] == 1.0 and first["time/data_loading_s"] == 0.25
    assert first["time/data_loading_pct"] == 25.0
    assert first["tokens_seen"] == 2000 and first["memory/cpu_rss_peak_gib"] == 1.25
    assert "throughput/tps_per_device_mean" not in first  # the first interval is start-up
    # Interval 2: 2 → 4 s, 3000 tokens: 750; the steady state so far is this interval.
    meter.add_step(3000, 0.0)
    clock.now = 4.0
    second = meter.collect()
    assert second["throughput/tps_per_device"] == 750 == second["throughput/tps_per_device_mean"]
    assert second["tokens_seen"] == 5000
    # Interval 3: 4 → 8 s, 1000 tokens: 125; mean since 2 s: 4000 / (6 s · 2) = 333.3.
    meter.add_step(1000, 0.0)
    clock.now = 8.0
    third = meter.collect()
    assert third["throughput/tps_per_device"] == 125
    assert third["throughput/tps_per_device_mean"] == pytest.approx(4000 / 12)
    assert third["throughput/mfu_pct_mean"] == pytest.approx(100 * FLOPS_PER_TOKEN * (4000 / 12) / PEAK)
    assert third["time/step_s"] == 4.0


def test_no_peak_means_no_mfu(clock: SimpleNamespace) -> None:
    """peak_flops None (low-precision matmuls): MFU is left out, not reported as 0."""
    meter = ThroughputMeter(FLOPS_PER_TOKEN, None, non_data_parallel_size=1, device=torch.device("cpu"))
    for _ in range(2):
        meter.add_step(100, 0.0)
        clock.now += 1.0
        metrics = meter.collect()
        assert not any("mfu" in key for key in metrics)
    assert metrics["throughput/tps_per_device_mean"] == 100


def test_each_collect_starts_a_new_interval(clock: SimpleNamespace) -> None:
    meter = ThroughputMeter(FLOPS_PER_TOKEN, PEAK, non_data_parallel_size=1, device=torch.device("cpu"))
    resets = meter.memory.resets
    meter.add_step(100, 0.5)
    clock.now = 1.0
    meter.collect()
    assert (meter.interval_tokens, meter.interval_steps, meter.data_seconds) == (0, 0, 0.0)
    assert meter.memory.resets == resets + 1


def test_a_peak_the_run_beats_is_raised_so_that_mfu_never_exceeds_100(clock: SimpleNamespace) -> None:
    """A CPU's peak measured on a busy machine is low: the first interval that beats it has it
    measured again (raise_peak), and MFU stays at or under 100% from then on."""
    beaten = []

    def raise_peak(achieved: float) -> float:
        beaten.append(achieved)
        return achieved * 1.25

    low = FLOPS_PER_TOKEN * 100  # a peak of 100 tokens/s: the run's 1000 beat it
    meter = ThroughputMeter(FLOPS_PER_TOKEN, low, 1, torch.device("cpu"), raise_peak)
    meter.add_step(1000, 0.0)
    clock.now = 1.0
    first = meter.collect()
    assert beaten == [FLOPS_PER_TOKEN * 1000] and first["throughput/mfu_pct"] == pytest.approx(80.0)
    meter.add_step(1100, 0.0)
    clock.now = 2.0
    second = meter.collect()
    assert len(beaten) == 1 and second["throughput/mfu_pct"] == pytest.approx(88.0)
    assert second["throughput/mfu_pct_mean"] <= 100
    # Without a way to measure again, the rate the run reached stands in for the peak.
    alone = ThroughputMeter(FLOPS_PER_TOKEN, low, 1, torch.device("cpu"))
    alone.add_step(1000, 0.0)
    clock.now = 3.0
    assert alone.collect()["throughput/mfu_pct"] == pytest.approx(100.0)


def test_the_steady_state_starts_once_the_writer_is_idle(clock: SimpleNamespace) -> None:
    """While rank 0's MLflow writer starts up beside the ranks, intervals run slower; the means cover
    the intervals after it, and until one has run, every interval after the first."""
    idle = SimpleNamespace(now=False)
    meter = ThroughputMeter(
        FLOPS_PER_TOKEN, PEAK, non_data_parallel_size=1, device=torch.device("cpu"), undisturbed=lambda: idle.now
    )
    tps = []
    for seconds, idle_at_the_end in ((1.0, False), (2.0, False), (2.0, True), (1.0, True), (1.0, True)):
        meter.add_step(1000, 0.0)
        clock.now += seconds
        idle.now = idle_at_the_end
        tps.append(meter.collect().get("throughput/tps_per_device_mean"))
    # Intervals 2 and 3 ran beside the writer (500 tokens/s); it was idle at the end of 3.
    assert tps[:3] == [None, 500, 500]
    assert tps[3:] == [1000, 1000]  # from the end of interval 3 on: the steady state alone


def test_the_time_a_peak_takes_to_measure_again_is_in_no_interval(clock: SimpleNamespace) -> None:
    """Measuring the peak again (raise_peak) takes time after the interval ended: not in its step
    seconds, the next interval's or the steady mean."""

    def raise_peak(achieved: float) -> float:
        clock.now += 5.0  # the measurement
        return achieved * 2

    meter = ThroughputMeter(FLOPS_PER_TOKEN, FLOPS_PER_TOKEN * 100, 1, torch.device("cpu"), raise_peak)
    for _ in range(3):
        meter.add_step(1000, 0.0)
        clock.now += 1.0
        metrics = meter.collect()
        assert metrics["time/step_s"] == 1.0 and metrics["throughput/tps_per_device"] == 1000
    assert metrics["throughput/tps_per_device_mean"] == 1000


def test_compare_reads_back_the_intervals_the_steady_mean_covers(clock: SimpleNamespace) -> None:
    """compare's spread (compare/runs.py's steady_intervals, from the metric histories) is over the
    intervals the last steady mean covers: their tokens over their seconds is that mean. A run
    resumed from step 2 logs steps 3-5 again from a new meter, whose writer was busy until the end
    of its third interval."""
    from titan_exp import metric_names as names
    from titan_exp.compare.runs import steady_intervals

    idle = SimpleNamespace(now=False)
    records = []  # (step, timestamp, the metrics of one log call)

    def train(first_step: int, seconds: list[float], idle_from: int) -> None:
        meter = ThroughputMeter(FLOPS_PER_TOKEN, PEAK, 1, torch.device("cpu"), undisturbed=lambda: idle.now)
        for n, interval in enumerate(seconds):
            meter.add_step(1000, 0.0)
            clock.now += interval
            idle.now = n + 1 >= idle_from
            records.append((first_step + n, len(records), meter.collect()))

    train(1, [3.0, 1.1, 1.3, 0.9, 1.2], idle_from=1)
    train(3, [2.5, 1.7, 1.9, 1.05, 0.95, 1.15], idle_from=3)
    tps, steady = (
        [
            SimpleNamespace(step=step, timestamp=at, value=metrics[key])
            for step, at, metrics in records
            if key in metrics
        ]
        for key in (names.TPS, names.TPS_MEAN)
    )
    window = steady_intervals(tps, steady)
    assert window == pytest.approx([1000 / 1.05, 1000 / 0.95, 1000 / 1.15])
    assert len(window) / sum(1 / t for t in window) == pytest.approx(records[-1][2][names.TPS_MEAN])

"""Per-log-interval throughput, MFU, memory and timing of one rank, with torchtitan's definitions."""

import time
from collections.abc import Callable

import torch

from titan_exp import metric_names as names
from titan_exp.metrics.memory import MemoryMonitor


class ThroughputMeter:
    """Accumulates tokens and time between two log steps for one rank."""

    def __init__(
        self,
        flops_per_token: int,
        peak_flops: float | None,
        non_data_parallel_size: int,
        device: torch.device,
        raise_peak: Callable[[float], float] | None = None,
        undisturbed: Callable[[], bool] = lambda: True,
    ):
        """peak_flops None: MFU is not defined (low-precision matmuls) and is not reported.
        `raise_peak(achieved)`: the peak once the run's FLOP/s beat it (a CPU's measured peak, taken
        while the machine was busy), at least `achieved`; without it the achieved rate stands in.
        `undisturbed()`: whether nothing of the job's own takes the ranks' CPU any more (rank 0's
        MLflow writer starting up beside ranks that fill the cores: ~2.7 CPU-seconds over the
        first steps, which ran ~40% slower on 2 CPU ranks); the steady state starts after it."""
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._raise_peak = raise_peak
        self.non_data_parallel_size = non_data_parallel_size
        self.memory = MemoryMonitor(device)
        self.tokens_seen = 0
        # Where the steady state starts: the end of the first interval (step 1: start-up,
        # compilation), then the end of the first interval that ended undisturbed, once one has run.
        self._steady_start: tuple[float, int] | None = None
        self._undisturbed = undisturbed
        self._undisturbed_start: tuple[float, int] | None = None
        self._reset()

    def _reset(self) -> None:
        self.interval_start = time.perf_counter()
        self.interval_tokens = 0
        self.interval_steps = 0
        self.data_seconds = 0.0
        self.memory.reset_peak()

    def add_step(self, tokens: int, data_seconds: float) -> None:
        self.interval_tokens += tokens
        self.tokens_seen += tokens
        self.interval_steps += 1
        self.data_seconds += data_seconds

    def leave_out(self, seconds: float) -> None:
        """Time that trained nothing (a validation pass), kept out of the throughput figures."""
        self.interval_start += seconds
        if self._steady_start is not None:
            self._steady_start = (self._steady_start[0] + seconds, self._steady_start[1])
        if self._undisturbed_start is not None:
            self._undisturbed_start = (self._undisturbed_start[0] + seconds, self._undisturbed_start[1])

    def collect(self) -> dict[str, float]:
        """Metrics of the interval since the previous call, then start a new interval.

        The `_mean` throughput figures are the run's steady state, which strategy comparisons and
        `plan calibrate` read: from the end of the first interval at whose end `undisturbed()`
        held, once an interval has run since; until then from the end of the first interval.
        """
        now = time.perf_counter()
        elapsed = now - self.interval_start
        tps = self._tps(self.interval_tokens, elapsed)
        self._keep_peak_above(self.flops_per_token * tps)  # its time comes after `now`: in no interval
        metrics = {
            names.TPS: tps,
            names.TFLOPS: self.flops_per_token * tps / 1e12,
            names.STEP_SECONDS: elapsed / self.interval_steps,
            names.DATA_SECONDS: self.data_seconds / self.interval_steps,
            names.DATA_PCT: 100 * self.data_seconds / elapsed,
            names.TOKENS_SEEN: self.tokens_seen,
            **self.memory.peak(),
        }
        if self.peak_flops:
            metrics[names.MFU] = self._mfu(tps)
        if self._steady_start is not None:
            start, tokens_before = self._undisturbed_start or self._steady_start
            mean_tps = self._tps(self.tokens_seen - tokens_before, now - start)
            metrics[names.TPS_MEAN] = mean_tps
            if self.peak_flops:
                metrics[names.MFU_MEAN] = self._mfu(mean_tps)
        self._reset()
        here = (self.interval_start, self.tokens_seen)  # the next interval's start
        if self._steady_start is None:
            self._steady_start = here
        if self._undisturbed_start is None and self._undisturbed():
            self._undisturbed_start = here
        return metrics

    def _keep_peak_above(self, achieved: float) -> None:
        """MFU never exceeds 100%: a peak the run beat was measured low, and is raised (the time that
        takes is kept out of the throughput figures)."""
        if not self.peak_flops or achieved <= self.peak_flops:
            return
        start = time.perf_counter()
        self.peak_flops = max(achieved, self._raise_peak(achieved)) if self._raise_peak else achieved
        if self._steady_start is not None:
            self.leave_out(time.perf_counter() - start)

    def _tps(self, tokens: int, seconds: float) -> float:
        return tokens / (seconds * self.non_data_parallel_size)

    def _mfu(self, tps: float) -> float:
        return 100 * self.flops_per_token * tps / self.peak_flops

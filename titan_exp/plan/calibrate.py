"""A device profile's figures fitted to measured runs (torch-free): the planner's model kept, only
the figures a profile states as "reachable fractions" or "measured here" moved, each within what
the hardware allows, to make the predicted tokens/s per device of the runs come out as measured;
and, apart (memory does not depend on them), the allocator's slack that brings the predicted
reserved peaks to the measured ones.

The fit minimises the mean squared log error of the predicted TPS (a run 10% slow weighs as one
10% fast; squared, so that figures which trade off meet in one smooth valley) by coordinate
descent: each figure in turn by golden-section search over its bounds, in log space, round after
round until they settle. Only figures that move some run's prediction are fitted; the others keep
the profile's value (a run without float8 says nothing of float8's efficiency).
"""

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from titan_exp.config.job import ResolvedJob
from titan_exp.estimate.config import HardwareConfig
from titan_exp.estimate.memory import rank_memory
from titan_exp.estimate.step_time import ComputeTimes
from titan_exp.job.memory import workload
from titan_exp.plan.predict import predict_step
from titan_exp.units import GIB

# What a fit may move on a GPU profile, and the bounds no real kernel leaves: a dense GEMM of
# training's shapes sustains between a tenth of the vendor's peak and all of it less the clocks'
# droop under load (cuBLAS on H100 peaks near 0.8 of the data-sheet figure); causal flash
# attention's forward at training's head widths between a fifth of the matmul peak and 0.8
# (FlashAttention-2, Dao 2023: 35-73% on A100 and H100; FlashAttention-3, Shah et al. 2024: ~75% on
# H100); elementwise kernels between 40% and 95% of the memory bandwidth (STREAM-like copies ~90%).
GPU_FIGURES: dict[str, tuple[float, float]] = {
    "matmul_efficiency": (0.1, 0.9),
    "float8_matmul_efficiency": (0.1, 0.9),
    "attention_efficiency": (0.2, 0.8),
    "memory_efficiency": (0.4, 0.95),
}
# On CPU ranks the compute is measured; what a fit moves is gloo's per-call cost and bandwidth,
# bounded by a loopback's (a microsecond to a tenth of a second a call; 0.1 to 100 GB/s), and how
# much ranks sharing cores lose beyond their share (none to twice).
CPU_FIGURES: dict[str, tuple[float, float]] = {
    "collective_latency_us": (1.0, 1e5),
    "reduce_latency_us": (1.0, 1e5),
    "intra_node_gbps": (0.1, 100.0),
    "time_sharing_cost": (1.0, 2.0),
}
# The allocator's slack (hardware.allocator_slack): from none to most of the live tensors again
# (fragmentation beyond that is a bug to fix, not a figure to plan with).
SLACK_BOUNDS = (0.0, 0.9)
# Fewer runs than this leave the figures a fit moves underdetermined.
MIN_RUNS = 3
# Rounds over the figures until none moves by more than 0.1% (figures that trade off, as the
# matmuls' and attention's efficiencies do, take several).
_MAX_ROUNDS, _CONVERGED = 30, 1e-3
_GOLDEN = (math.sqrt(5) - 1) / 2
_SEARCH_STEPS = 20  # golden-section steps per figure: the bracket shrinks to 0.618^20 ≈ 7e-5 of its span


@dataclass(frozen=True)
class Observation:
    """One measured run: its job (resolved as a plan resolves it), the profile it ran on, its
    steady tokens/s per device, and, on CPU ranks, the compute the planner measured for it and how
    much sharing cores stretches it."""

    label: str
    job: ResolvedJob
    hw: HardwareConfig
    tps: float
    compute: ComputeTimes | None = None
    oversubscription: float = 1.0
    reserved_gib: float | None = None  # the measured peak (CUDA: max reserved; CPU: resident set)

    def predicted_tps(self, figures: dict[str, float] | None = None) -> float:
        """With `figures` (name → value) in place of its profile's."""
        hw = dataclasses.replace(self.hw, **(figures or {}))
        return predict_step(self.job, hw, self.compute, self.oversubscription)[1]

    def predicted_reserved_gib(self, slack: float | None = None) -> float:
        """The busiest rank's reserved peak, with the allocator's slack `slack` (None: the profile's)."""
        w = workload(self.job.config, self.hw.device)
        if slack is not None:
            w = dataclasses.replace(w, allocator_slack=slack)
        return rank_memory(w).reserved / GIB


def tps_error_pct(observations: Sequence[Observation], figures: dict[str, float] | None = None) -> float:
    """Mean absolute TPS error, percent of the measured figure."""
    return statistics.mean(abs(100 * (o.predicted_tps(figures) / o.tps - 1)) for o in observations)


def fit(
    observations: Sequence[Observation], bounds: dict[str, tuple[float, float]], start: HardwareConfig
) -> dict[str, float]:
    """The values of the figures in `bounds` (name → (low, high)) that bring `observations`
    closest, the same in every observation's profile, starting from `start`'s; a figure that moves
    no prediction keeps `start`'s value."""
    if not observations:
        raise ValueError("no runs to fit the profile to")
    values = {name: getattr(start, name) for name in bounds}

    def log_error(candidate: dict[str, float]) -> float:
        return statistics.mean(math.log(o.predicted_tps(candidate) / o.tps) ** 2 for o in observations)

    def along(name: str) -> Callable[[float], float]:
        return lambda log_value: log_error(values | {name: math.exp(log_value)})

    def moves(name: str) -> bool:
        low, high = (math.log(bound) for bound in bounds[name])
        return along(name)(low) != along(name)(high)

    movable = [name for name in bounds if moves(name)]
    for _ in range(_MAX_ROUNDS):
        before = dict(values)
        for name in movable:
            best = _golden_section(along(name), *(math.log(bound) for bound in bounds[name]))
            if along(name)(best) < log_error(values):
                values[name] = math.exp(best)
        if all(abs(math.log(values[name] / before[name])) < _CONVERGED for name in movable):
            break
    return values


def fit_allocator_slack(observations: Sequence[Observation]) -> float | None:
    """The allocator's slack (within SLACK_BOUNDS) that brings the runs' predicted reserved peaks
    closest to the measured ones (mean squared log error); None without a run that measured one."""
    measured = [o for o in observations if o.reserved_gib]
    if not measured:
        return None

    def log_error(slack: float) -> float:
        return statistics.mean(math.log(o.predicted_reserved_gib(slack) / o.reserved_gib) ** 2 for o in measured)

    return _golden_section(log_error, *SLACK_BOUNDS)


def _golden_section(error: Callable[[float], float], low: float, high: float) -> float:
    """The minimum of `error` over [low, high] (unimodal there: a figure's error falls, then rises)."""
    a, b = low, high
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = error(c), error(d)
    for _ in range(_SEARCH_STEPS):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = error(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = error(d)
    return (a + b) / 2

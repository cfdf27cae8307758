"""One layout's prediction: the busiest rank's peak memory and step time, tokens/s per device and
MFU, and whether it fits the memory budget (torch-free: from estimate/memory.py and estimate/step_time.py,
with compute times measured on this machine where the caller has them)."""

import copy
import dataclasses
import math
from dataclasses import dataclass

from launchers.devices import available_memory
from titan_exp.config.job import ResolvedJob
from titan_exp.config.resolve import DEFAULT_CPU_RANKS, resolve
from titan_exp.config.schema import JobConfig
from titan_exp.config.sections import PlanConfig
from titan_exp.estimate.config import HardwareConfig
from titan_exp.estimate.memory import DTYPE_BYTES, RankMemory, model_parameters, part_parameters, rank_memory
from titan_exp.estimate.step_time import ComputeTimes, StepBatch, StepTime, modelled_compute, step_time
from titan_exp.metrics.flops import flops_per_token
from titan_exp.units import GIB

MEASURED, MODELLED = "measured", "modelled"


@dataclass(frozen=True)
class Prediction:
    layout: str
    mesh: str
    world_size: int
    memory: RankMemory
    memory_budget_gib: float
    step: StepTime
    tps_per_device: float
    mfu_pct: float
    # Which figures were measured on this machine and which modelled.
    sources: dict[str, str]

    @property
    def peak_gib(self) -> float:
        return self.memory.total / GIB

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.memory_budget_gib

    def metrics(self) -> dict[str, float]:
        """As MLflow metrics (prediction/*), beside the measured runs' names."""
        memory = {f"prediction/memory_{k}_gib": v / GIB for k, v in dataclasses.asdict(self.memory).items()}
        step = {f"prediction/step_{k}_s": v for k, v in self.step.breakdown().items()}
        return {
            "prediction/peak_memory_gib": self.peak_gib,
            "prediction/memory_budget_gib": self.memory_budget_gib,
            "prediction/fits": float(self.fits),
            "prediction/tps_per_device": self.tps_per_device,
            "prediction/mfu_pct": self.mfu_pct,
            **memory,
            **step,
        }


def matmul_dtype(cfg: JobConfig) -> str:
    return "float8" if cfg.quantize.name in ("float8", "mxfp8") else cfg.training.mixed_precision_param


def local_parameters(cfg: JobConfig) -> float:
    """Parameters one rank holds after sharding (the first stage's under pipelining)."""
    p = cfg.parallelism
    shards = max(1, p.data_parallel_shard_degree * p.context_parallel_degree)
    layers = math.ceil(cfg.model.n_layers / p.pipeline_parallel_degree)
    return part_parameters(cfg.model, p.pipeline_parallel_degree, layers) / (p.tensor_parallel_degree * shards)


def microbatch_tokens(cfg: JobConfig) -> tuple[int, int]:
    """(samples, sequence length) one rank runs per microbatch."""
    p, t = cfg.parallelism, cfg.training
    samples = p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else t.local_batch_size
    return samples, t.seq_len // p.context_parallel_degree


def resolve_for_plan(cfg: JobConfig) -> ResolvedJob:
    """`cfg` resolved as for a dry run: the world as the launcher spells it out, or as the degrees do
    (on the `cpu` profile, the local default of 2 ranks where neither does), checked, nothing placed."""
    cfg = copy.deepcopy(cfg)
    degrees = cfg.parallelism.degrees().values()
    if cfg.launcher.nproc_per_node == -1 and min(degrees) > 0:
        cfg.launcher.nproc_per_node = math.prod(degrees) // cfg.launcher.nodes
    elif cfg.launcher.nproc_per_node == -1 and cfg.hardware.name == "cpu":
        cfg.launcher.nproc_per_node = DEFAULT_CPU_RANKS
    return resolve(cfg, place=False)


def memory_budget_gib(cfg: JobConfig, hw: HardwareConfig, plan: PlanConfig) -> float:
    """What one rank may use: plan.memory_budget_gib, else the device's memory less the margin (on
    the `cpu` profile, this machine's available memory shared by its ranks)."""
    if plan.memory_budget_gib is not None:
        return plan.memory_budget_gib
    if hw.memory_gib < 0:  # to be measured: what this machine has available now
        hw = dataclasses.replace(hw, memory_gib=(available_memory() or 0) / GIB)
    budget = hw.memory_gib * (1 - plan.memory_margin)
    return budget / cfg.launcher.nproc_per_node if hw.name == "cpu" else budget


def predicted_memory(cfg: JobConfig) -> RankMemory:
    """The busiest rank's tensors at its peak, as an allocator or memory tracker counts them (the
    pre-flight check adds a CPU process's own memory and its allocator's slack)."""
    t = cfg.training
    return rank_memory(
        cfg.model, cfg.parallelism, t.local_batch_size, t.seq_len, t.mixed_precision_param,
        cfg.activation_checkpoint, on_cpu=False,
    )  # fmt: skip


def predict(
    job: ResolvedJob,
    hw: HardwareConfig,
    plan: PlanConfig,
    compute: ComputeTimes | None,
    oversubscription: float = 1.0,
    measured_memory: dict[str, float] | None = None,
) -> Prediction:
    """`cfg` resolved (degrees filled in); `hw` with nothing left to measure; `compute`: times measured
    on this machine (CPU ranks), or None to model them from FLOPs; `measured_memory`: rank 0's peak
    by category (bytes, RankMemory's names) from the dry run's pass, or None to model it."""
    cfg, dims = job.config, job.dims
    t, p, m = cfg.training, cfg.parallelism, cfg.model
    sources = {"memory": MODELLED, "communication": MODELLED, "bubble": MODELLED}
    if measured_memory is None:
        memory = predicted_memory(cfg)
    else:  # the categories the pass has (no separate logits, no process baseline: tensors only)
        memory = RankMemory(**{f.name: int(measured_memory.get(f.name, 0)) for f in dataclasses.fields(RankMemory)})
        sources["memory"] = MEASURED + " (fake pass, extrapolated over layers; in-flight microbatches modelled)"
    samples, tokens = microbatch_tokens(cfg)
    if compute is None:
        dtype = matmul_dtype(cfg)
        ac_mode = cfg.activation_checkpoint.mode
        compute = modelled_compute(m, hw, (samples * tokens, t.seq_len), dims.tp, dtype, ac_mode, local_parameters(cfg))
        sources["compute"] = MODELLED
    else:
        sources["compute"] = MEASURED
    accumulation = job.accumulation
    param_bytes = DTYPE_BYTES[t.mixed_precision_param]
    batch = StepBatch(t.local_batch_size, t.seq_len, accumulation, param_bytes, param_bytes)
    step = step_time(m, p, hw, compute, batch, oversubscription)
    tokens_per_step = t.local_batch_size * accumulation * t.seq_len
    tps = tokens_per_step / step.total / dims.non_data_parallel_size
    per_token = flops_per_token(m, model_parameters(m), m.vocab_size * m.dim, t.seq_len)
    mfu = 100 * per_token * tps / hw.peak_flops(matmul_dtype(cfg))
    return Prediction(
        layout=dims.label(),
        mesh=dims.describe(),
        world_size=dims.world_size,
        memory=memory,
        memory_budget_gib=memory_budget_gib(cfg, hw, plan),
        step=step,
        tps_per_device=tps,
        mfu_pct=mfu,
        sources=sources,
    )

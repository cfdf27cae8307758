"""One layout's prediction: the busiest rank's peak memory (active and reserved) and step time,
tokens/s per device and MFU, and whether it fits the memory budget (torch-free: from
estimate/memory.py through job/memory.py, the figure the pre-flight check and plan.prune print too,
and estimate/step_time.py, with compute times measured on this machine where the caller has them).
The dry run's fake pass, where measured, is a cross-check shown beside the model's figure."""

import copy
import dataclasses
import math
from dataclasses import dataclass

from launchers.devices import available_memory
from launchers.local import DEFAULT_CPU_RANKS
from titan_exp.config.job import ResolvedJob
from titan_exp.config.resolve import resolve
from titan_exp.config.schema import JobConfig
from titan_exp.estimate.bands import Band, band
from titan_exp.estimate.config import HardwareConfig
from titan_exp.estimate.gpu_compute import gpu_compute
from titan_exp.estimate.memory import RankMemory, rank_memory
from titan_exp.estimate.step_time import ComputeTimes, StepTime, step_time
from titan_exp.estimate.workload import model_parameters
from titan_exp.job.memory import Budget, memory_fixes, planned_device, workload
from titan_exp.metrics.flops import flops_per_token
from titan_exp.rules import ConfigError
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
    # The dry run's fake pass (tensors only, no allocator): a cross-check of `memory.active`.
    fake_pass: RankMemory | None = None
    # Where it does not fit: the nearest changes that fit by the same model (job/memory.py).
    fixes: tuple[str, ...] = ()
    # The share of its threads' time the compute's timing got on this machine (1.0: none timed here).
    cpu_share: float = 1.0
    # How far TPS and the peak are to be trusted on this hardware (estimate/bands.py).
    tps_band: Band = Band(0.0, "")
    memory_band: Band = Band(0.0, "")

    @property
    def tps_range(self) -> tuple[float, float]:
        return self.tps_band.around(self.tps_per_device)

    @property
    def peak_gib(self) -> float:
        """The reserved peak, what a fit is judged on."""
        return self.memory.reserved / GIB

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.memory_budget_gib

    def metrics(self) -> dict[str, float]:
        """As MLflow metrics (prediction/*), beside the measured runs' names."""
        fields = (f.name for f in dataclasses.fields(RankMemory) if f.name != "phase")
        memory = {f"prediction/memory_{k}_gib": getattr(self.memory, k) / GIB for k in fields}
        step = {f"prediction/step_{k}_s": v for k, v in self.step.breakdown().items()}
        cross_check = {"prediction/fake_pass_active_gib": self.fake_pass.active / GIB} if self.fake_pass else {}
        return {
            "prediction/peak_memory_gib": self.peak_gib,
            "prediction/peak_active_gib": self.memory.active / GIB,
            "prediction/peak_reserved_gib": self.memory.reserved / GIB,
            "prediction/memory_budget_gib": self.memory_budget_gib,
            "prediction/fits": float(self.fits),
            "prediction/tps_per_device": self.tps_per_device,
            "prediction/tps_band_pct": self.tps_band.pct,
            "prediction/memory_band_pct": self.memory_band.pct,
            "prediction/mfu_pct": self.mfu_pct,
            **memory,
            **step,
            **cross_check,
        }


def matmul_dtype(cfg: JobConfig) -> str:
    return "float8" if cfg.quantize.name in ("float8", "mxfp8") else cfg.training.mixed_precision_param


def resolve_for_plan(cfg: JobConfig) -> ResolvedJob:
    """`cfg` resolved as for a dry run: the world as the launcher spells it out, or as the degrees do
    (on the `cpu` profile, the local default of 2 ranks where neither does), checked, nothing placed."""
    cfg = copy.deepcopy(cfg)
    degrees = cfg.parallelism.degrees().values()
    if cfg.launcher.nproc_per_node == -1 and min(degrees) > 0:
        cfg.launcher.nproc_per_node = math.prod(degrees) // cfg.launcher.nodes
    elif cfg.launcher.nproc_per_node == -1 and cfg.hardware.device == "cpu":
        cfg.launcher.nproc_per_node = DEFAULT_CPU_RANKS
    return resolve(cfg, place=False)


def memory_budget(cfg: JobConfig, hw: HardwareConfig) -> Budget:
    """What one rank may use on `hw` (job/memory.py's Budget): the profile's memory (on the `cpu`
    profile, this machine's available memory, shared by its ranks)."""
    if hw.memory_gib < 0:  # to be measured: what this machine has available now
        hw = dataclasses.replace(hw, memory_gib=(available_memory() or 0) / GIB)
    return Budget.of(cfg, hw.memory_gib * GIB, hw.device == "cpu", f"hardware={hw.name}")


def predict(
    job: ResolvedJob,
    hw: HardwareConfig,
    compute: ComputeTimes | None,
    oversubscription: float = 1.0,
    fake_pass: RankMemory | None = None,
) -> Prediction:
    """`job` resolved; `hw` with nothing left to measure; `compute`: times measured on this machine
    (CPU ranks), or None to model them op by op; `fake_pass`: rank 0's peak from the dry run's
    pass, shown beside the model's as its cross-check."""
    cfg, dims = job.config, job.dims
    w = workload(cfg, planned_device(cfg))
    sources = {"memory": MODELLED, "communication": MODELLED, "bubble": MODELLED}
    sources["compute"] = MODELLED if compute is None else MEASURED
    step, tps = predict_step(job, hw, compute, oversubscription)
    t, m = cfg.training, cfg.model
    per_token = flops_per_token(m, model_parameters(m), m.vocab_size * m.dim, t.seq_len)
    mfu = 100 * per_token * tps / hw.peak_flops(matmul_dtype(cfg))
    memory, budget = rank_memory(w), memory_budget(cfg, hw)
    per_rank = budget.per_rank(cfg.launcher.nproc_per_node)
    return Prediction(
        layout=dims.label(),
        mesh=dims.describe(),
        world_size=dims.world_size,
        memory=memory,
        memory_budget_gib=per_rank / GIB,
        step=step,
        tps_per_device=tps,
        mfu_pct=mfu,
        sources=sources,
        fake_pass=fake_pass,
        fixes=tuple(memory_fixes(cfg, w, budget)) if memory.reserved > per_rank else (),
        tps_band=band(hw.name, "tps"),
        memory_band=band(hw.name, "memory"),
    )


def predict_step(
    job: ResolvedJob, hw: HardwareConfig, compute: ComputeTimes | None, oversubscription: float = 1.0
) -> tuple[StepTime, float]:
    """The step's time alone, and tokens/s per device (what a calibration fits: plan/calibrate.py)."""
    cfg = job.config
    w = workload(cfg, planned_device(cfg))
    step = step_time(w, hw, compute or gpu_compute(w, hw), oversubscription)
    tokens_per_step = cfg.training.local_batch_size * w.accumulation * cfg.training.seq_len
    return step, tokens_per_step / step.total / job.dims.non_data_parallel_size


def check_plannable(job: ResolvedJob) -> None:
    """Refuse, in one line, what the hardware profile cannot run (so the planner cannot model it)."""
    cfg = job.config
    hw, quantize = cfg.hardware, cfg.quantize.name
    if quantize == "mxfp8" and not hw.mxfp8:
        raise ConfigError(
            "quantize", quantize, f"hardware={hw.name} has no MX float8 matmuls; plan it on hardware=b200 or gb200"
        )
    if quantize == "float8" and hw.device != "cpu" and hw.peak_tflops_float8 <= hw.peak_tflops_bfloat16:
        raise ConfigError(
            "quantize", quantize, f"hardware={hw.name} has no float8 matmuls (torchao needs sm89+); use quantize=none"
        )


def planned_shapes(job: ResolvedJob) -> str:
    """What a step runs, in one line: batch, sequence, accumulation, dtypes, AC, compile, float8."""
    cfg = job.config
    t, w = cfg.training, workload(cfg, planned_device(cfg))
    quantize = f"{cfg.quantize.name} {cfg.quantize.recipe}" if cfg.quantize.name == "float8" else cfg.quantize.name
    ac = cfg.activation_checkpoint
    return (
        f"local batch {t.local_batch_size} × seq {t.seq_len} (global batch {t.global_batch_size}, "
        f"accumulation {w.accumulation}), params {t.mixed_precision_param}, reduce {t.mixed_precision_reduce}, "
        f"AC {ac.mode}{' ' + ac.selective_ac_option if ac.mode == 'selective' else ''}, "
        f"compile {'on' if cfg.compile.enable else 'off'}, quantize {quantize}"
    )

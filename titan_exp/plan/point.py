"""One point of a plan: its job composed as the command line would, and predicted, with what this
machine can measure for it (on the `cpu` profile: the device's figures and a rank's compute)."""

import dataclasses
from typing import NamedTuple

from hydra import compose, initialize_config_dir

from launchers.devices import cpu_cores
from titan_exp import CONF_DIR
from titan_exp.config.compose import to_job_config
from titan_exp.config.job import ResolvedJob
from titan_exp.config.schema import JobConfig
from titan_exp.estimate.config import HardwareConfig
from titan_exp.estimate.step_time import ComputeTimes
from titan_exp.estimate.workload import local_parameters
from titan_exp.job.memory import workload
from titan_exp.plan.predict import Prediction, matmul_dtype, predict, resolve_for_plan


def compose_point(point: list[str]) -> ResolvedJob:
    """The point's job, resolved for planning (predict.resolve_for_plan)."""
    return resolve_for_plan(compose_config(point))


def compose_config(point: list[str]) -> JobConfig:
    """The point's config, composed as the command line would."""
    # Hydra's own keys place a run's outputs: nothing to place here.
    point = [override for override in point if not override.startswith("hydra.")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_job_config(compose(config_name="config", overrides=point), point)


def cpu_ranks(job: ResolvedJob) -> tuple[int, float]:
    """(threads per rank, how much the ranks' time stretches as they share this machine's cores)."""
    cores, ranks, threads = cpu_cores(), job.placement.nproc_per_node, job.placement.threads_per_rank
    share = ranks * threads / cores
    return threads, share * job.config.hardware.time_sharing_cost if share > 1 else 1.0


def plan_one(job: ResolvedJob) -> Prediction:
    """Model the layout; measure what torch can here: on the `cpu` profile the device's figures and
    a rank's compute, and (plan.measure) rank 0's memory by the dry run's fake pass, the memory
    model's cross-check."""
    cfg = job.config
    if not cfg.plan.measure and (cfg.hardware.device != "cpu" or cfg.hardware.kernel_tables):
        # All modelled, no torch to load: on CPU ranks from a probed profile's kernel tables.
        stretch = cpu_ranks(job)[1] if cfg.hardware.device == "cpu" else 1.0
        return predict(job, cfg.hardware, compute=None, oversubscription=stretch)
    from titan_exp.plan import measure  # torch: measuring is this command's job

    fake_pass = measure.fake_pass_memory(job) if cfg.plan.measure else None
    inputs = step_inputs(job)
    prediction = predict(job, inputs.hw, inputs.compute, inputs.oversubscription, fake_pass)
    if cfg.hardware.device == "cpu" and prediction.mfu_pct > 100:
        # The timing beat the cached peak, measured on a busy machine: measured again (MFU <= 100%).
        dtype = "bfloat16" if matmul_dtype(cfg) == "float8" else matmul_dtype(cfg)  # emulated on a CPU
        beaten_by = prediction.mfu_pct / 100 * inputs.hw.peak_flops(dtype)
        threads, _ = cpu_ranks(job)
        hw = measure.raised_peak(inputs.hw, dtype, threads, cfg.data.cache_dir, beaten_by)
        prediction = predict(job, hw, inputs.compute, inputs.oversubscription, fake_pass)
    return dataclasses.replace(prediction, cpu_share=inputs.cpu_share)


class StepInputs(NamedTuple):
    """What the step model needs beside the job: the profile (on `cpu`, with its figures measured
    here), a rank's compute (measured on `cpu`; None: modelled per op), how much ranks sharing
    cores stretch (1.0 off `cpu`), and the share of its threads' time the compute's timing got."""

    hw: HardwareConfig
    compute: ComputeTimes | None
    oversubscription: float
    cpu_share: float = 1.0


def step_inputs(job: ResolvedJob) -> StepInputs:
    cfg, hw = job.config, job.config.hardware
    if hw.device != "cpu":
        return StepInputs(hw, None, 1.0)
    from titan_exp.plan import measure  # torch: measuring is this command's job

    threads, oversubscription = cpu_ranks(job)
    hw = measure.resolve_hardware(hw, threads, cfg.data.cache_dir)  # beside the measured peak FLOP/s
    w = workload(cfg, "cpu")
    shape = (w.microbatch, w.seq_len // w.parallelism.context_parallel_degree)  # this rank's microbatch
    compute, share = measure.measured_compute(cfg, shape, job.dims, local_parameters(w), threads)
    return StepInputs(hw, compute, oversubscription, share)

"""Rank 0's part of training: the job's facts, throughput and MFU, the console and the MLflow run.
The other ranks hold a Follower, which says and records nothing, so the trainer never asks which
rank it is."""

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_exp import metric_names as names
from titan_exp.config.job import ResolvedJob
from titan_exp.estimate.hardware_profiles import profile_for_device
from titan_exp.job import events
from titan_exp.metrics import startup
from titan_exp.metrics.expert_load import EXPERT_LOAD_ARTIFACT, plot_expert_load
from titan_exp.metrics.flops import flops_per_token
from titan_exp.metrics.format import format_line, format_summary
from titan_exp.metrics.throughput import ThroughputMeter
from titan_exp.progress import time_left
from titan_exp.tracking.run import DEVICE_PROFILE_PARAM, UNREAD_KEYS_PARAM
from titan_exp.tracking.writer import BackgroundTracker
from titan_exp.train.step import StepOutcome

# The run's artifact that gives the host at each position of the mesh (ParallelMesh.host_grid).
MESH_HOSTS_ARTIFACT = "mesh_hosts.json"


@dataclass(frozen=True)
class RunFacts:
    """What the trainer tells the leader once the run is built."""

    job: ResolvedJob
    # Of the whole model (for FLOPs per token).
    num_params: int
    num_embedding_params: int
    device: torch.device
    # Each rank's host by global rank (None on one process), the host at each mesh position, and
    # whether each mesh dim spans hosts (parallel/mesh.py).
    hosts: list[str] | None
    host_grid: dict | None
    dims_across_hosts: dict[str, bool]


class Follower:
    """A rank other than 0: takes part in every collective, says and records nothing."""

    is_writer = False
    last: dict[str, object] = {}

    def say(self, text: str) -> None:
        pass

    def start(self, facts: RunFacts) -> None:
        pass

    def count(self, step: int, outcome: StepOutcome, audit_metrics: dict[str, float]) -> None:
        pass

    def log(self, step: int, outcome: StepOutcome, loss_avg: float, loss_max: float) -> None:
        pass

    def log_validation(self, step: int, loss: float, seconds: float) -> None:
        pass

    def report_startup(self, step: int) -> None:
        pass

    def log_expert_load(self, load: dict[int, list[float]], steps: tuple[int, int], job_dir: Path) -> None:
        pass

    def log_artifacts(self, folder: Path, artifact_dir: str) -> None:
        pass


class Leader(Follower):
    """Rank 0: the job's facts, throughput and MFU, the console, the MLflow run (`tracker`, None
    when tracking is off)."""

    is_writer = True

    def __init__(
        self,
        tracker: BackgroundTracker | None,
        peak_flops: float,
        job_dir: Path | None = None,
        raise_peak: Callable[[float], float] | None = None,
    ):
        """`job_dir`: where the job's events go (job/events.py); None: nowhere. `raise_peak`: the
        device's peak measured again once the run beats it (a CPU's: metrics/peak_flops.py)."""
        self.tracker, self.peak_flops, self.job_dir = tracker, peak_flops, job_dir
        self.raise_peak = raise_peak
        self.meter: ThroughputMeter | None = None
        self.last: dict[str, object] = {}
        self.tokens_per_step = 0
        self.steps = 0
        # (when, which) this start's first step ended: the time left is paced by the steps after it,
        # its start-up (compilation, allocation) left out.
        self._paced_from: tuple[float, int] | None = None

    def say(self, text: str) -> None:
        print(text, flush=True)

    def _peak_beaten(self, achieved: float) -> float:
        peak = self.raise_peak(achieved)
        self.say(
            f"titan_exp: this run's {achieved / 1e12:.3f} TFLOP/s beat the device's peak "
            f"{self.peak_flops / 1e12:.3f} (measured while the machine was busy): measured again, {peak / 1e12:.3f}"
        )
        self.peak_flops = peak
        return peak

    def start(self, facts: RunFacts) -> None:
        """The job's facts, printed and tracked; the meter started."""
        job = facts.job
        t, dims = job.config.training, job.dims
        per_token = flops_per_token(job.config.model, facts.num_params, facts.num_embedding_params, t.seq_len)
        logged = {
            "derived/num_params": facts.num_params,
            "derived/flops_per_token": per_token,
            **job.layout_params(),
            "derived/peak_flops_per_device": self.peak_flops,
            "derived/device": facts.device.type,
            **_placement_facts(facts.device),
        }
        print(format_summary(logged), flush=True)
        hosts = facts.hosts or []
        if len(set(hosts)) > 1:
            print(f"hosts: {_ranks_by_host(hosts)}; {_spans(facts.dims_across_hosts)}", flush=True)
        if self.tracker:
            self.tracker.log_params(logged | {UNREAD_KEYS_PARAM: ",".join(job.unread_keys)})
            if hosts:
                self.tracker.set_tag("hosts", ",".join(dict.fromkeys(hosts)))
            if facts.host_grid:  # an artifact: a large job's grid outgrows a param
                self.tracker.log_text(json.dumps(facts.host_grid), MESH_HOSTS_ARTIFACT)
        # MFU is not defined against a bf16 peak once matmuls run in lower precision (torchtitan omits it too).
        mfu_peak = None if job.config.quantize.low_precision else self.peak_flops
        self.meter = ThroughputMeter(
            per_token,
            mfu_peak,
            dims.non_data_parallel_size,
            facts.device,
            self.raise_peak and self._peak_beaten,
            self.tracker.writer_idle if self.tracker else lambda: True,
        )
        self.tokens_per_step = t.local_batch_size * t.seq_len * job.accumulation
        self.steps = t.steps

    def count(self, step: int, outcome: StepOutcome, audit_metrics: dict[str, float]) -> None:
        """The step's tokens and data time into the meter; a memory audit's figures into the run."""
        if self.tracker and audit_metrics:
            self.tracker.log_metrics(step, audit_metrics)
        self.meter.add_step(self.tokens_per_step, outcome.data_seconds)
        if self._paced_from is None:
            self._paced_from = (time.monotonic(), step)

    def report_startup(self, step: int) -> None:
        """After the first step: where the start-up went (metrics/startup.py); a writer that waited
        for the first step starts now."""
        startup.mark("first_step")
        print(startup.summary_line(), flush=True)
        if self.tracker:
            self.tracker.log_metrics(step, startup.as_metrics())
            self.tracker.start()

    def log(self, step: int, outcome: StepOutcome, loss_avg: float, loss_max: float) -> None:
        self.last = {
            names.LOSS: loss_avg,
            names.LOSS_MAX: loss_max,
            names.GRAD_NORM: outcome.grad_norm.item(),
            names.LR: outcome.lr,
            **self.meter.collect(),
            **outcome.expert_load,
        }
        if self.tracker:  # queued before printed: a step on the console is a step in the run
            self.tracker.log_metrics(step, self.last)
        if self.job_dir is not None:
            events.emit(self.job_dir, events.STEP, step=step, loss=loss_avg)
        ended_at, first = self._paced_from
        left = time_left(step - first, self.steps - first, time.monotonic() - ended_at)
        print(format_line(step, self.steps, self.last, left), flush=True)

    def log_validation(self, step: int, loss: float, seconds: float) -> None:
        self.meter.leave_out(seconds)
        self.last[names.VALIDATION_LOSS] = loss
        if self.tracker:
            self.tracker.log_metrics(step, {names.VALIDATION_LOSS: loss})
        print(f"step {step:5d}  validation loss {loss:7.4f}", flush=True)

    def log_expert_load(self, load: dict[int, list[float]], steps: tuple[int, int], job_dir: Path) -> None:
        """The run's expert load (metrics/expert_load.py), plotted beside the job and into the run."""
        plot_expert_load(load, steps, job_dir / EXPERT_LOAD_ARTIFACT)
        if self.tracker:
            self.tracker.log_artifact(job_dir / EXPERT_LOAD_ARTIFACT, "")

    def log_artifacts(self, folder: Path, artifact_dir: str) -> None:
        if self.tracker and folder.is_dir():
            self.tracker.log_artifacts(folder, artifact_dir)


def _placement_facts(device: torch.device) -> dict[str, str]:
    """Where rank 0 ran: its cores (its affinity) and, on CUDA, the GPUs it could see, its name and
    the hardware profile that stands for it (what `plan calibrate --hardware` finds the run by)."""
    facts = {"derived/cpu_set": _ranges(sorted(os.sched_getaffinity(0)))}
    if device.type == "cuda":
        facts["derived/cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
        name = torch.cuda.get_device_name(device)
        facts["derived/device_name"] = name
        # Found: a GPU no profile lists stopped the run already, at its MFU peak (metrics/peak_flops.py).
        facts[DEVICE_PROFILE_PARAM] = profile_for_device(name).name
    return facts


def _ranks_by_host(hosts: list[str]) -> str:
    """['tn1', 'tn1', 'tn2', 'tn2'] → 'tn1 (ranks 0-1), tn2 (ranks 2-3)'."""
    ranks: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        ranks.setdefault(host, []).append(rank)
    return ", ".join(f"{host} (ranks {_ranges(numbers)})" for host, numbers in ranks.items())


def _spans(across: dict[str, bool]) -> str:
    """{'dp_replicate': True, 'dp_shard': False} → 'dp_replicate across hosts, dp_shard within one'."""
    return ", ".join(f"{dim} {'across hosts' if spans else 'within one'}" for dim, spans in across.items())


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] → '0-2,5'."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)

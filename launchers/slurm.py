"""launcher=slurm: rank processes as one Slurm job, submitted through submitit's Slurm executor: `tasks_per_node`
tasks on each of `nodes` nodes, one task per rank, started by the srun of the batch script that
submitit writes. The submitting process can print that script instead (no Slurm needed), or submit
the job and follow it: rank 0's output streamed, the job's state read from slurmctld (`scontrol`,
which needs no accounting database), its result returned or its end raised (launchers/slurm_job.py).

Inside the job each task takes its torch.distributed environment from Slurm (launchers/env.py: the
first node's address, the port the batch script found free there, derived from the job id) and
keeps CUDA_VISIBLE_DEVICES as Slurm binds it. SIGTERM (scancel, the time limit) is left to act,
where submitit would ignore it, and SIGUSR2 (sent signal_delay_s ahead of the time limit, or on
preemption) asks the ranks to stop at their next step (launchers/signals.py); `leave_for_requeue`
then puts the job back in the queue.
"""

import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Optional

import submitit
from submitit.slurm.slurm import _make_sbatch_string

from launchers import signals
from launchers.base import (
    ConfigError,
    JobSpec,
    Launcher,
    MemoryBudget,
    Placement,
    PlacementRequest,
    Requeue,
    check_one_line,
    check_submitted_from_here,
    ranks_per_node_by_degrees,
)
from launchers.env import export_slurm_environment
from launchers.heartbeat import heartbeat_file, start_beating
from launchers.signals import StopRequested
from launchers.slurm_job import SlurmJob
from launchers.tasks import run_recording_failures

# A requeued task's exit status (submitit's own requeue exits so too), and how long a rank other than
# 0 waits for the requeue to end it.
_REQUEUED_EXIT = 255
_REQUEUE_WAIT_SECONDS = 60.0


@dataclass
class SlurmOptions:
    """What a Slurm job asks for beyond its size, in sbatch's words, and how it is followed: the
    keys of the `launcher` section that launcher=slurm alone reads. None and empty leave Slurm's
    default."""

    # -1: one GPU per rank with device=cuda, none with device=cpu (filled in when the job is resolved).
    gpus_per_node: int = -1
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[float] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    # Slurm sends SIGUSR2 this long before the time limit: the ranks stop together at the next step,
    # save a checkpoint and requeue the job, which resumes in the same MLflow run.
    signal_delay_s: int = 120
    # How many times a job that reached its time limit is requeued.
    max_num_timeout: int = 3
    # How many times a job with checkpoint.enable is requeued when one of its ranks stops answering
    # (launcher.heartbeat_timeout_s; its node failed, or it hung): it resumes from its last
    # checkpoint once Slurm has nodes for it. Past that, or without checkpoints, the job is cancelled.
    max_num_node_failures: int = 3
    # Shell lines run in the batch script before the ranks start (module load, conda activate, ...).
    setup: list[str] = field(default_factory=list)
    # Extra arguments of the srun that starts the ranks, and any other sbatch option (name: value).
    srun_args: list[str] = field(default_factory=list)
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    # false: print the batch script that would be submitted, submit nothing.
    submit: bool = True
    # false: return once the job is submitted (its log paths are printed).
    wait: bool = True
    # Sweep points submitted at once (queued or running), at most.
    array_parallelism: int = 256

    def check_options(self) -> None:
        """These keys against each other and the job's time limit (launcher.timeout_min: checked as
        part of the launcher section); raises ConfigError."""
        timeout_min = self.timeout_min
        if not 0 <= self.signal_delay_s < 60 * timeout_min:
            raise ConfigError(
                "launcher.signal_delay_s",
                self.signal_delay_s,
                f"must lie in [0, launcher.timeout_min × 60 = {60 * timeout_min}) seconds: "
                "the warning comes that long before the time limit",
            )
        for name in ("max_num_timeout", "max_num_node_failures"):
            if getattr(self, name) < 0:
                raise ConfigError(f"launcher.{name}", getattr(self, name), "must be >= 0")
        if self.array_parallelism <= 0:
            raise ConfigError("launcher.array_parallelism", self.array_parallelism, "must be > 0")
        if self.gpus_per_node < -1:
            raise ConfigError("launcher.gpus_per_node", self.gpus_per_node, "must be >= 0 or -1 (one per rank)")
        for name in ("cpus_per_task", "mem_gb"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"launcher.{name}", value, "must be > 0")
        for name in ("partition", "account", "qos", "constraint", "srun_args", "additional_parameters"):
            check_one_line(f"launcher.{name}", getattr(self, name))


@dataclass(frozen=True)
class SlurmJobSpec:
    """One job: its name and size, its ranks' threads, and the options (gpus_per_node resolved)."""

    job_name: str
    nodes: int
    tasks_per_node: int
    timeout_min: int
    options: SlurmOptions = field(default_factory=SlurmOptions)
    # OMP_NUM_THREADS of every rank.
    threads_per_task: int = 1

    def sbatch_parameters(self) -> dict[str, Any]:
        """The parameters of submitit's SlurmExecutor (and of the batch script it writes)."""
        o = self.options
        chosen = {
            "gpus_per_node": max(o.gpus_per_node, 0) or None,
            "cpus_per_task": o.cpus_per_task,
            "mem": _memory(o.mem_gb),
            "partition": o.partition,
            "account": o.account,
            "qos": o.qos,
            "constraint": o.constraint,
            "setup": [*o.setup, rendezvous_port_line()],
            "srun_args": list(o.srun_args) or None,
            "additional_parameters": dict(o.additional_parameters) or None,
        }
        return {
            "job_name": self.job_name,
            "nodes": self.nodes,
            "ntasks_per_node": self.tasks_per_node,
            "time": self.timeout_min,
            "signal_delay_s": o.signal_delay_s,
            "stderr_to_stdout": True,
            **{key: value for key, value in chosen.items() if value is not None},
        }


def _memory(gb: float | None) -> str | None:
    if gb is None:
        return None
    return f"{int(gb)}GB" if gb == int(gb) else f"{int(gb * 1024)}MB"


def rendezvous_port_line(python: str = sys.executable) -> str:
    """The batch script's last setup line: it runs on the job's first node, where rank 0 will
    listen, and exports the first port from the one derived from the job id that is free there
    (launchers/rendezvous.py); srun hands it to every task. A MASTER_PORT of the user's stands."""
    return f"export MASTER_PORT=${{MASTER_PORT:-$({shlex.quote(python)} -m launchers.rendezvous)}}"


def task_command(python: str = sys.executable) -> str:
    """How srun starts each task's Python: with SIGUSR2 ignored until the rank listens for it
    (_task_entry). Slurm may send its time-limit warning up to a minute early, and SIGUSR2 kills a
    process that has no handler yet; an ignored disposition survives the exec."""
    return f"""bash -c 'trap "" USR2; exec "$@"' -- {shlex.quote(python)}"""


def batch_script(spec: SlurmJobSpec, folder: Path) -> str:
    """The batch script `submit` would hand to sbatch, word for word (submitit's own rendering)."""
    folder = folder.absolute()
    command = " ".join([task_command(), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(command=command, folder=folder, **spec.sbatch_parameters())


def refusal(spec: SlurmJobSpec, folder: Path) -> str | None:
    """Why Slurm would refuse this job (an unknown partition, more memory than a node has, an
    option sbatch does not know), asked with `sbatch --test-only`, which submits nothing; None if
    it would take it."""
    try:
        asked = subprocess.run(
            ["sbatch", "--test-only"], input=batch_script(spec, folder), capture_output=True, text=True, timeout=60
        )
    except FileNotFoundError:
        return "sbatch is not on this machine's PATH (launcher=slurm submits from a Slurm login node)"
    if asked.returncode == 0:
        return None
    said = [line.strip().removeprefix("sbatch: error: ") for line in asked.stderr.splitlines() if line.strip()]
    return "; ".join(said) or f"sbatch --test-only exited with {asked.returncode}"


def submit(fn: Callable[[Any], Any], arg: Any, spec: SlurmJobSpec, folder: Path) -> str:
    """Submit fn(arg) as one task per rank; the job's files go under `folder` (on a file system
    every node sees). Its job id."""
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=0, python=task_command())  # requeueing is ours
    executor.update_parameters(**spec.sbatch_parameters())
    return executor.submit(_task_entry, fn, arg, spec.threads_per_task).job_id


def _task_entry(fn: Callable[[Any], Any], arg: Any, threads: int) -> Any:
    """One rank of the job, inside submitit's task process."""
    # A result of an earlier run of this job (before a requeue) must not stand for this one.
    job = submitit.JobEnvironment()
    result = job.paths.result_pickle
    result.unlink(missing_ok=True)
    result.with_name(result.name + ".save_tmp").unlink(missing_ok=True)  # one cut short (see leave_for_requeue)
    export_slurm_environment()
    os.environ["OMP_NUM_THREADS"] = str(threads)  # before the rank imports torch
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # submitit's tasks bypass it; rank 0 records KILLED
    signals.stop_on(signal.SIGUSR2)
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    start_beating(heartbeat_file(job.paths.folder, f"{job.job_id}_r{restarts}", job.global_rank))
    return run_recording_failures(fn, arg)


def leave_for_requeue(is_rank0: bool) -> NoReturn:
    """From inside the job: rank 0 puts it back in the queue (Slurm then ends this run of it; it
    starts again when slurmctld allows, cred_expire + 1 s after the requeue: 2 minutes by default),
    the other ranks wait for that end. Either way the task leaves without a result, as submitit's
    own requeue does: a result being saved as Slurm ends the task is left half-written
    (`<result>.save_tmp`), and the next run of the task trips over it."""
    if is_rank0:
        with signals.ignored(signal.SIGTERM):  # the requeue ends this run of the job: finish the call
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
    else:
        time.sleep(_REQUEUE_WAIT_SECONDS)
    sys.exit(_REQUEUED_EXIT)


class SlurmLauncher(Launcher):
    name = "slurm"
    options = SlurmOptions
    folder_name = "slurm"
    on_this_machine = False
    warns_before_stopping = True

    @staticmethod
    def environment_tags() -> dict[str, str]:
        return {"slurm_job_id": os.environ.get("SLURM_JOB_ID", "")}

    def placement(self, request: PlacementRequest) -> Placement:
        """A Slurm job's nodes are not this machine: counts come from the config alone. Ranks per
        node: launcher.nproc_per_node, else one per GPU of launcher.gpus_per_node, else the degrees'
        product over the nodes; device auto is cuda unless launcher.gpus_per_node=0."""
        o = self.section
        check_submitted_from_here(request, self.name, "a Slurm job", " (or submit from outside the job step)")
        if request.nproc_per_node == -1 and o.gpus_per_node <= 0:
            # With gpus_per_node=0 (CPU nodes) there are no GPUs to count ranks by.
            ranks_per_node_by_degrees(request, self.name, "" if o.gpus_per_node == 0 else "launcher.gpus_per_node, or ")
        if request.device == "cpu" and o.gpus_per_node > 0:
            raise ConfigError(
                "launcher.gpus_per_node", o.gpus_per_node, "launcher.device=cpu takes no GPUs; set it to 0"
            )
        gpus, nproc = o.gpus_per_node, request.nproc_per_node
        if request.device != "cpu" and gpus > 0 and nproc > gpus:
            raise ConfigError(
                "launcher.nproc_per_node", nproc, f"exceeds launcher.gpus_per_node={gpus}: each rank needs its own GPU"
            )
        device = request.device if request.device != "auto" else ("cpu" if gpus == 0 else "cuda")
        if nproc == -1:
            nproc = gpus if gpus > 0 else ranks_per_node_by_degrees(request, self.name)
        threads = request.cpu_threads_per_rank
        if threads == -1:
            threads = o.cpus_per_task or 1
        return Placement(self.name, device, nproc, request.nodes, threads)

    def resolved_options(self, placement: Placement) -> dict[str, object]:
        """gpus_per_node filled in: one per rank on cuda, none on cpu."""
        gpus = self.section.gpus_per_node
        return {
            "gpus_per_node": gpus if gpus != -1 else (placement.nproc_per_node if placement.device == "cuda" else 0)
        }

    def memory_budget(self, placement: Placement) -> MemoryBudget | None:
        """launcher.mem_gb per node, for a CPU job that sets it (a GPU job's ranks hold their GPUs)."""
        mem_gb = self.section.mem_gb
        if placement.device != "cpu" or mem_gb is None:
            return None
        return MemoryBudget(int(mem_gb * 1024**3), shared=True, what=f"launcher.mem_gb={mem_gb:g} per node")

    def points_in_flight(self) -> int:
        return self.section.array_parallelism

    def job_spec(self, spec: JobSpec) -> SlurmJobSpec:
        """What a job asks Slurm for."""
        placement, o = spec.placement, self.section
        options = SlurmOptions(**{f.name: getattr(o, f.name) for f in dataclasses.fields(SlurmOptions)})
        options = dataclasses.replace(options, **self.resolved_options(placement))
        return SlurmJobSpec(
            job_name="titan_exp:" + spec.name.replace("·", "-"),
            nodes=placement.nodes,
            tasks_per_node=placement.nproc_per_node,
            timeout_min=spec.timeout_min,
            options=options,
            threads_per_task=placement.threads_per_rank,
        )

    def described_only(self, spec: JobSpec, folder: Path) -> str | None:
        """launcher.submit=false: the batch script that would be submitted."""
        return None if self.section.submit else batch_script(self.job_spec(spec), folder)

    def refusal(self, spec: JobSpec, folder: Path) -> str | None:
        refused = refusal(self.job_spec(spec), folder)
        return f"Slurm would refuse this job: {refused}" if refused else None

    def place(self, target: Callable[[Any], Any], arg: Any, spec: JobSpec, folder: Path, echo: Callable[[str], None]):
        """Submit the job; None unless it is to be followed (launcher.wait=false: its log paths are
        printed and it runs on)."""
        job_id = submit(target, arg, self.job_spec(spec), folder)
        # A rank lost (its node failed) requeues the job where it can resume from a checkpoint.
        requeues = self.section.max_num_node_failures if spec.resumable else 0
        ranks = spec.placement.world_size
        job = SlurmJob(job_id, folder.absolute(), ranks, echo, spec.heartbeat_timeout_s, requeues)
        echo(f"Slurm job {job_id} submitted: {ranks} ranks, logs {job.folder / f'{job_id}_<rank>_log.out'}")
        return job if self.section.wait else None

    def restarted(self) -> bool:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0

    def after_stop(self, stop: StopRequested, elapsed_s: float, can_resume: bool, job_dir: Path, is_rank0: bool) -> str:
        """Requeued if the job can resume (a checkpoint, and requeues for timeouts left). A stop
        counts as a time limit once the job has run as long as submitit says a timeout takes (the
        lesser of 80% of the limit and the limit less 10 minutes); earlier, as a preemption."""
        limit_s = 60 * self.section.timeout_min
        kind = "TIMEOUT" if elapsed_s >= min(0.8 * limit_s, limit_s - 600) else "PREEMPTED"
        what = f"{kind}: Slurm sent {stop.signal_name} and the ranks stopped after step {stop.step}"
        if not can_resume:
            return f"{what}; checkpoint.enable=false, so there is nothing to resume from"
        if kind == "TIMEOUT":
            counter = job_dir / "slurm_timeouts"
            used = int(counter.read_text()) if counter.exists() else 0
            if used >= self.section.max_num_timeout:
                return f"{what}; requeued for its time limit {used} times already (launcher.max_num_timeout)"
            if is_rank0:
                counter.write_text(str(used + 1))
        raise Requeue(f"{what}; requeued to resume from its checkpoint")

    def leave_for_requeue(self, is_rank0: bool) -> NoReturn:
        leave_for_requeue(is_rank0)

"""Rank processes as one Slurm job, submitted through submitit's Slurm executor: `tasks_per_node`
tasks on each of `nodes` nodes, one task per rank, started by the srun of the batch script that
submitit writes. The submitting process can print that script instead (no Slurm needed), or submit
the job and follow it: rank 0's output streamed, the job's state read from slurmctld (`scontrol`,
which needs no accounting database), its result returned or its end raised.

Inside the job each task takes its torch.distributed environment from Slurm (launchers/env.py: the
first node's address, the port the batch script found free there, derived from the job id) and
keeps CUDA_VISIBLE_DEVICES as Slurm binds it. SIGTERM (scancel, the time limit) is left to act,
where submitit would ignore it, and SIGUSR2 (sent signal_delay_s ahead of the time limit, or on
preemption) asks the ranks to stop at their next step (launchers/signals.py); `leave_for_requeue`
then puts the job back in the queue.
"""

import os
import re
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
from submitit.core.utils import JobPaths
from submitit.slurm.slurm import _make_sbatch_string

from launchers import signals
from launchers.env import export_slurm_environment
from launchers.heartbeat import beating_host, heartbeat_file, silence, silent_for, start_beating
from launchers.tasks import LogFollower, RankFailure, log_tail, read_result, run_recording_failures

# How often rank 0's log is read while the job runs, and how often slurmctld is asked for its state.
POLL_SECONDS = 0.2
STATE_POLL_SECONDS = 1.0
# After a Ctrl-C, how long the submitting process waits for the cancelled job to end (Slurm gives
# its tasks KillWait, 30 s by default, between SIGTERM and SIGKILL).
CANCEL_GRACE_SECONDS = 90.0
# Job states after which Slurm runs nothing more of the job (REQUEUED, PENDING etc. are not final).
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)
# Final states that mean the job was stopped from outside rather than failing by itself.
STOPPED_STATES = frozenset({"CANCELLED", "TIMEOUT", "PREEMPTED", "DEADLINE"})

# A requeued task's exit status (submitit's own requeue exits so too), and how long a rank other than
# 0 waits for the requeue to end it.
_REQUEUED_EXIT = 255
_REQUEUE_WAIT_SECONDS = 60.0


@dataclass
class SlurmOptions:
    """What a Slurm job asks for beyond its size, in sbatch's words, and how titan_exp follows it:
    the `launcher` config section's keys that launcher=slurm alone reads (declared here once; the
    section extends this class). None and empty leave Slurm's default."""

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


@dataclass(frozen=True)
class JobStatus:
    state: str
    reason: str
    exit_code: str
    restarts: int

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


class SlurmJobEnded(RuntimeError):
    """The job ended without a result from its ranks: cancelled, timed out, killed, node failure."""

    def __init__(self, job_id: str, status: JobStatus, log_path: Path):
        self.job_id, self.status, self.log_path = job_id, status, log_path
        # KILLED rather than FAILED in the job's MLflow run (tracking/run.py: outcome).
        self.interrupted = status.state in STOPPED_STATES
        detail = f"reason {status.reason}, exit code {status.exit_code}"
        super().__init__(f"Slurm job {job_id} {status.state} ({detail}); {log_tail(log_path)} (log: {log_path})")


class SlurmJob:
    """A submitted job: its files in `folder`, its state in slurmctld."""

    def __init__(self, job_id: str, folder: Path, ntasks: int):
        self.job_id, self.folder, self.ntasks = job_id, folder, ntasks

    def paths(self, task: int) -> JobPaths:
        return JobPaths(self.folder, job_id=self.job_id, task_id=task)

    def log(self, task: int) -> Path:
        return self.paths(task).stdout

    def status(self) -> JobStatus | None:
        """The job's state, or None once slurmctld has forgotten it (MinJobAge after its end)."""
        out = subprocess.run(["scontrol", "show", "job", "-o", self.job_id], capture_output=True, text=True)
        if out.returncode != 0:
            if "Invalid job id" in out.stderr:
                return None
            raise RuntimeError(f"scontrol show job {self.job_id} failed: {out.stderr.strip()}")
        fields = dict(re.findall(r"(\w+)=(\S*)", out.stdout))
        return JobStatus(
            fields["JobState"], fields.get("Reason", ""), fields.get("ExitCode", ""), int(fields.get("Restarts", 0))
        )

    def requeue(self) -> None:
        """Back to the queue: Slurm ends this run of the job and starts it again once it can."""
        subprocess.run(["scontrol", "requeue", self.job_id], check=True, capture_output=True)

    def cancel(self, signal_name: str | None = None) -> None:
        """scancel the job, or with `signal_name` only signal its tasks (e.g. USR2)."""
        flags = [f"--signal={signal_name}"] if signal_name else []
        subprocess.run(["scancel", *flags, self.job_id], check=True)


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


def submit(fn: Callable[[Any], Any], arg: Any, spec: SlurmJobSpec, folder: Path) -> SlurmJob:
    """Submit fn(arg) as one task per rank; the job's files go under `folder` (on a file system
    every node sees)."""
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=0, python=task_command())  # requeueing is ours
    executor.update_parameters(**spec.sbatch_parameters())
    job = executor.submit(_task_entry, fn, arg, spec.threads_per_task)
    return SlurmJob(job.job_id, folder.absolute(), spec.nodes * spec.tasks_per_node)


def wait(job: SlurmJob, echo: Callable[[str], None], heartbeat_timeout_s: float, requeues_when_silent: int = 0) -> Any:
    """Follow the job to its end, handing rank 0's output lines to `echo`; return rank 0's result,
    or raise RankFailure (a rank raised, or stopped beating for `heartbeat_timeout_s`) or
    SlurmJobEnded. A silent rank (hung, or its node down) gets the job requeued, to resume from its
    checkpoint once Slurm has the nodes, `requeues_when_silent` times at most; then cancelled. A
    Ctrl-C cancels the job and waits (CANCEL_GRACE_SECONDS at most) for it to end before raising
    KeyboardInterrupt; a second one stops waiting at once."""
    output = LogFollower(job.log(0), echo)
    heartbeats = _Heartbeats(job, heartbeat_timeout_s, requeues_when_silent, echo)
    try:
        status = _follow(job, output, deadline=None, heartbeats=heartbeats)
    except KeyboardInterrupt:
        job.cancel()
        _follow(job, output, deadline=time.monotonic() + CANCEL_GRACE_SECONDS)
        raise
    output.poll()
    return _outcome(job, status, echo)


def _follow(
    job: SlurmJob, output: LogFollower, deadline: float | None, heartbeats: "_Heartbeats | None" = None
) -> JobStatus | None:
    """Poll until the job is over (or the deadline passes); its last status (None: forgotten)."""
    next_state_poll = 0.0
    while True:
        output.poll()
        if time.monotonic() >= next_state_poll:
            status = job.status()
            if status is None or status.final or (deadline is not None and time.monotonic() > deadline):
                return status
            if heartbeats is not None and status.state == "RUNNING":
                heartbeats.check(status.restarts)
            next_state_poll = time.monotonic() + STATE_POLL_SECONDS
        time.sleep(POLL_SECONDS)


class _Heartbeats:
    """The tasks' heartbeats, watched from the submitting process: a task of the job's current run
    that has not beaten for `limit_s` (a task still starting has no beat yet) gets the job
    requeued while `requeues` last, then cancelled."""

    def __init__(self, job: SlurmJob, limit_s: float, requeues: int, echo: Callable[[str], None]):
        self.job, self.limit_s, self.requeues, self.echo = job, limit_s, requeues, echo
        self._requeued: set[int] = set()  # runs of the job (Slurm's restart count) already requeued

    def check(self, restarts: int) -> None:
        """Raise RankFailure (the job cancelled) for a silent task of run `restarts`, unless it is requeued."""
        if restarts in self._requeued:  # on its way back to the queue: its tasks are being killed
            return
        for task in range(self.job.ntasks):
            beats = heartbeat_file(self.job.folder, f"{self.job.job_id}_r{restarts}", task)
            silent = silent_for(beats)
            if silent is None or silent <= self.limit_s:
                continue
            if len(self._requeued) < self.requeues:
                self._requeued.add(restarts)
                self.job.requeue()
                then = f"job {self.job.job_id} requeued to resume from its checkpoint (launcher.max_num_node_failures)"
                self.echo(f"titan_exp: rank {task} {silence(silent, self.limit_s, then, beating_host(beats))}")
                return
            self.job.cancel()
            reason = silence(silent, self.limit_s, f"job {self.job.job_id} cancelled", beating_host(beats))
            raise RankFailure(task, reason, self.job.log(task))


def _outcome(job: SlurmJob, status: JobStatus | None, echo: Callable[[str], None]) -> Any:
    """Rank 0's result once every rank left one; otherwise the root cause: the earliest rank that
    raised, else Slurm's word on the job."""
    finished, raised = [], []
    for task in range(job.ntasks):
        pickle = job.paths(task).result_pickle
        try:
            finished.append(read_result(task, pickle, job.log(task)))
        except RankFailure as failure:
            raised.append((pickle.stat().st_mtime, failure))
    if raised:
        raise min(raised, key=lambda pair: pair[0])[1]
    status = status or JobStatus("UNKNOWN", "forgotten by slurmctld", "", 0)
    if all(done for done, _ in finished):
        if status.state != "COMPLETED":  # e.g. a rank aborting in its teardown, after its result
            echo(f"titan_exp: every rank finished, yet Slurm says {status.state} (exit code {status.exit_code})")
        return finished[0][1]
    raise SlurmJobEnded(job.job_id, status, job.log(0))


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

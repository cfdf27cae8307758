"""Following a submitted Slurm job to its end (launchers/slurm.py submits it): rank 0's output
streamed, the job's state read from slurmctld (`scontrol`, which needs no accounting database), its
tasks' heartbeats watched, its result returned or its end raised."""

import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from submitit.core.utils import JobPaths

from launchers.base import PlacedJob
from launchers.heartbeat import beating_host, heartbeat_file, silence, silent_for
from launchers.tasks import LogFollower, RankFailure, log_tail, read_result

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


class SlurmJob(PlacedJob):
    """A submitted job: its files in `folder`, its state in slurmctld; followed (`follow`) with its
    rank 0's output handed to `echo`, its silent ranks requeued `requeues_when_silent` times."""

    def __init__(
        self,
        job_id: str,
        folder: Path,
        ntasks: int,
        echo: Callable[[str], None],
        heartbeat_timeout_s: float,
        requeues_when_silent: int,
    ):
        self.job_id, self.folder, self.ntasks = job_id, folder, ntasks
        self.echo, self.heartbeat_timeout_s, self.requeues_when_silent = echo, heartbeat_timeout_s, requeues_when_silent
        self.where = f"Slurm job {job_id}"

    def follow(self) -> Any:
        return wait(self, self.echo, self.heartbeat_timeout_s, self.requeues_when_silent)

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


def wait(job: SlurmJob, echo: Callable[[str], None], heartbeat_timeout_s: float, requeues_when_silent: int) -> Any:
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
    """Rank 0's result once every rank left one; otherwise the root cause: a job stopped from
    outside (scancel, its time limit, a preemption), else the earliest rank that raised, else
    Slurm's word on the job. Slurm signals a cancelled job's tasks one by one: a rank may raise
    first, its peer gone (gloo's connection closed), and that is not why the job ended."""
    finished, raised = [], []
    for task in range(job.ntasks):
        pickle = job.paths(task).result_pickle
        try:
            finished.append(read_result(task, pickle, job.log(task)))
        except RankFailure as failure:
            raised.append((pickle.stat().st_mtime, failure))
    status = status or JobStatus("UNKNOWN", "forgotten by slurmctld", "", 0)
    if raised:
        first = min(raised, key=lambda pair: pair[0])[1]
        if status.state not in STOPPED_STATES:
            raise first
        ended = SlurmJobEnded(job.job_id, status, job.log(0))
        ended.add_note(f"meanwhile rank {first.rank} raised: {first.reason}")
        raise ended
    if all(done for done, _ in finished):
        if status.state != "COMPLETED":  # e.g. a rank aborting in its teardown, after its result
            echo(f"titan_exp: every rank finished, yet Slurm says {status.state} (exit code {status.exit_code})")
        return finished[0][1]
    raise SlurmJobEnded(job.job_id, status, job.log(0))

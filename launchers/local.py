"""launcher=local: rank processes on this machine through submitit's local executor, one task per
rank (or, under torchrun or srun, this process as one rank of theirs), supervised until they end
(launchers/local_supervisor.py)."""

import contextlib
import faulthandler
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from launchers import signals
from launchers.base import ConfigError, JobSpec, Launcher, MemoryBudget, PlacedJob, Placement, PlacementRequest
from launchers.devices import available_memory, cpu_cores, gpu_memory, threads_per_rank, visible_gpus
from launchers.env import RankEnv, export
from launchers.heartbeat import heartbeat_file, start_beating
from launchers.local_supervisor import Supervisor, pid_file_name
from launchers.processes import stop_when_gone
from launchers.rendezvous import free_port
from launchers.tasks import run_recording_failures


def _rank_entry(
    fn: Callable[[Any], Any], arg: Any, master_port: int, nproc: int, pid_dir: str, launcher_pid: int
) -> Any:
    stop_when_gone(launcher_pid)  # also listens to SIGINT, which the controller ignores
    faulthandler.enable()  # a crash (SIGSEGV, SIGABRT, ...) names itself in the rank's log
    job = submitit.JobEnvironment()
    export(RankEnv(job.global_rank, job.local_rank, job.num_tasks, nproc), "127.0.0.1", master_port)
    # Written whole or not at all: the supervisor polls these files (an empty one read once: int('')).
    pid_file = Path(pid_dir, pid_file_name(job.job_id, job.global_rank))
    partial = pid_file.with_suffix(".partial")
    partial.write_text(str(os.getpid()))
    partial.replace(pid_file)
    start_beating(heartbeat_file(Path(pid_dir), job.job_id, job.global_rank))
    return run_recording_failures(fn, arg)


@contextlib.contextmanager
def _environment(**values: str):
    """Variables the ranks inherit (through submitit's controller) set only around submission."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


# Ranks on a machine without GPUs when neither the launcher nor the degrees say how many.
DEFAULT_CPU_RANKS = 2
_GIB = 1024**3


@dataclass
class LocalOptions:
    """launcher=local reads no keys beyond those every launcher reads."""


class LocalLauncher(Launcher):
    name = "local"
    options = LocalOptions
    folder_name = "ranks"
    on_this_machine = True

    def placement(self, request: PlacementRequest) -> Placement:
        """Ranks per node: launcher.nproc_per_node, or for -1 the degrees' product when none is -1,
        else one per visible GPU, else DEFAULT_CPU_RANKS; under torchrun or srun, their counts."""
        if request.started_by is None and request.nodes != 1:
            raise ConfigError(
                "launcher.nodes", request.nodes, "launcher=local runs on this machine only; set launcher.nodes=1"
            )
        gpus = visible_gpus() if request.device != "cpu" else 0
        if request.started_by:
            env = RankEnv.from_environ()
            nproc, nodes = env.local_world_size, env.world_size // env.local_world_size
        else:
            nproc, nodes = _ranks_per_node(request, gpus), 1
        if request.device == "cuda" and gpus == 0:
            raise ConfigError(
                "launcher.device", "cuda", "no GPU is visible on this machine; use launcher.device=cpu or auto"
            )
        spawned_here = request.started_by is None
        if spawned_here and request.device != "cpu" and gpus and nproc > gpus:
            raise ConfigError(
                "launcher.nproc_per_node", nproc, f"only {gpus} GPU(s) visible; lower it or use launcher.device=cpu"
            )
        device = "cuda" if gpus and request.device != "cpu" else "cpu"
        threads = request.cpu_threads_per_rank
        if threads == -1:
            # torchrun and srun set OMP_NUM_THREADS for their ranks; this launcher shares the cores out.
            inherited = os.environ.get("OMP_NUM_THREADS") if request.started_by else None
            threads = int(inherited) if inherited else threads_per_rank(cpu_cores(), nproc)
        return Placement(request.started_by or self.name, device, nproc, nodes, threads)

    def check_room(self, placement: Placement, oversubscribe: bool) -> None:
        """A core per CPU rank this launcher starts, unless oversubscribing is asked for: more ranks
        than cores time-share them, and every speed figure of the run is then meaningless."""
        cores = cpu_cores()
        if placement.started_by == self.name and placement.device == "cpu" and placement.nproc_per_node > cores:
            if not oversubscribe:
                raise ConfigError(
                    "launcher.nproc_per_node",
                    placement.nproc_per_node,
                    f"more CPU ranks than the {cores} core(s) this process may use; lower it, or add "
                    "launcher.oversubscribe=true to time-share the cores (fine for parity checks, not for speed)",
                )

    def memory_budget(self, placement: Placement) -> MemoryBudget | None:
        """One GPU's memory, or the memory this machine has available, which its CPU ranks share.
        Ranks that torchrun or srun started share the node with siblings already allocating: not known."""
        if placement.started_by != self.name:
            return None
        if placement.device == "cuda":
            memory = gpu_memory()
            return MemoryBudget(memory, shared=False, what="one GPU's memory") if memory else None
        available = available_memory()
        if available is None:
            return None
        return MemoryBudget(available, shared=True, what=f"{available / _GIB:.1f} GiB available on this machine")

    def place(self, target: Callable[[Any], Any], arg: Any, spec: JobSpec, folder: Path, echo: Callable[[str], None]):
        """fn(arg) in the spec's rank processes on this machine, each with the torch.distributed
        environment of its rank, its threads (OMP_NUM_THREADS) and, on cuda, one GPU; their logs, pid
        files, heartbeats and results under `folder`."""
        placement = spec.placement
        folder.mkdir(parents=True, exist_ok=True)
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(
            tasks_per_node=placement.nproc_per_node,
            nodes=1,
            gpus_per_node=placement.nproc_per_node if placement.device == "cuda" else 0,
            timeout_min=spec.timeout_min,
            stderr_to_stdout=True,
        )
        # submitit's controller process inherits an ignored SIGINT: on a terminal's Ctrl-C it would
        # otherwise SIGKILL the ranks 1 s later, cutting short what rank 0 records; the supervisor
        # stops them instead, with a grace period.
        with _environment(OMP_NUM_THREADS=str(placement.threads_per_rank)), signals.ignored(signal.SIGINT):
            job = executor.submit(
                _rank_entry, target, arg, free_port(), placement.nproc_per_node, str(folder), os.getpid()
            )
        return LocalJob(job, placement.nproc_per_node, folder, spec.heartbeat_timeout_s, echo)


def _ranks_per_node(request: PlacementRequest, gpus: int) -> int:
    if request.nproc_per_node != -1:
        return request.nproc_per_node
    if request.degrees_product is not None:
        return request.degrees_product
    return gpus or DEFAULT_CPU_RANKS


class LocalJob(PlacedJob):
    """The rank processes of a local job, supervised until they end."""

    def __init__(self, job, nproc: int, folder: Path, heartbeat_timeout_s: float, echo: Callable[[str], None]):
        self.supervisor = Supervisor(job, nproc, folder, heartbeat_timeout_s, echo)

    def follow(self) -> Any:
        """Rank 0's result, or RankFailure: a rank failed, or stopped beating. Every rank is stopped
        when it returns (or when a Ctrl-C reaches it)."""
        return self.supervisor.run()

    def cancel(self) -> None:
        self.supervisor.stop_all()

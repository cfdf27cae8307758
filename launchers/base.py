"""The seam every engine that places rank processes sits behind (one module each; launchers/registry.py
lists them). From plain parameters an engine says where a job's ranks will run (`placement`), places
them (`place`) and follows the placed job to its end; from inside a rank it says what a request to
stop means for the job (`after_stop`). The launching side (titan_exp/job/launch.py) names an engine
by the `launcher` option and never asks which one it is."""

import unicodedata
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from launchers.entrypoint import Entrypoint
from launchers.signals import StopRequested


class ConfigError(ValueError):
    """An option that cannot work, named with its value and the fix: one line on the command line,
    exit 2, nothing started. Every config rule raises it, the engines' own (titan_exp/rules.py)."""

    def __init__(self, key: str, value: object, fix: str):
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key}={value}: {fix}")


def _commands_a_line(char: str) -> bool:
    """A control character (C0, DEL, C1: ESC and the 8-bit CSI among them) or a Unicode line break."""
    return unicodedata.category(char) == "Cc" or char in "\u2028\u2029"


def printable(text: str) -> str:
    """`text` from elsewhere (a cluster's output) safe to print: each control character but the tab
    written as its escape (\\x1b), so none commands the terminal."""
    return "".join(ascii(c)[1:-1] if c != "\t" and _commands_a_line(c) else c for c in text)


def check_one_line(key: str, value: object) -> None:
    """Text that lands in a line of a script or a file name (a Slurm option, a run name): no line
    breaks or other control characters, which would start a line of their own or, printed, command
    the terminal (ESC and the 8-bit CSI start its escape sequences). Lists and mappings are checked
    item by item."""
    if isinstance(value, dict):
        texts = [*value.keys(), *value.values()]
    else:
        texts = value if isinstance(value, list) else [value]
    for text in texts:
        if isinstance(text, str) and any(map(_commands_a_line, text)):
            raise ConfigError(key, repr(text), "must not hold a line break or other control character")


@dataclass(frozen=True)
class Placement:
    """Where a job's ranks run, worked out once by its engine (or by torchrun/srun's environment)."""

    # The engine that places the ranks (`local`, `slurm`, ...), or torchrun | srun when this process
    # is one rank of a job they started; None in a dry run, which places nothing.
    started_by: str | None
    device: str  # cpu | cuda
    nproc_per_node: int
    nodes: int
    threads_per_rank: int

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nodes


@dataclass(frozen=True)
class PlacementRequest:
    """What the launcher section asks of an engine before -1 and auto are filled in."""

    nproc_per_node: int  # -1: as many as the engine works out
    nodes: int
    device: str  # auto | cpu | cuda
    cpu_threads_per_rank: int  # -1: the engine's share of the cores
    oversubscribe: bool
    # The product of the parallel degrees (None when one of them is -1: whatever the world is).
    degrees_product: int | None
    # torchrun | srun when this process is one rank of their job (launchers/env.py), else None.
    started_by: str | None


def check_submitted_from_here(request: PlacementRequest, engine: str, job: str, where: str = "") -> None:
    """An engine that submits `job` (a Slurm job, a Ray job) of its own: not from inside one rank of
    another job, and on at least one node."""
    if request.started_by:
        raise ConfigError(
            "launcher",
            engine,
            f"submits {job} of its own, but this process is already one rank of a {request.started_by} job; "
            f"drop launcher={engine} there{where}",
        )
    if request.nodes <= 0:
        raise ConfigError("launcher.nodes", request.nodes, "must be > 0")


def ranks_per_node_by_degrees(request: PlacementRequest, engine: str, or_else: str = "") -> int:
    """Ranks per node for an engine that cannot count a node's devices from here: the parallel
    degrees' product over the nodes; `or_else`: the engine's other way to say it ("KEY, or ")."""
    if request.degrees_product is None:
        raise ConfigError(
            "launcher.nproc_per_node",
            -1,
            f"launcher={engine} cannot count a node's devices from here; set launcher.nproc_per_node "
            f"(or {or_else}every parallel degree)",
        )
    if request.degrees_product % request.nodes:
        raise ConfigError(
            "launcher.nodes",
            request.nodes,
            f"does not divide the degrees' product {request.degrees_product}; set launcher.nproc_per_node",
        )
    return request.degrees_product // request.nodes


@dataclass(frozen=True)
class SharedFolder:
    """A folder every node of a job must see (where the ranks' nodes need not share this machine's
    disk): the key that names it, and the fix where a node does not."""

    key: str
    value: str  # the key's value, as the user wrote it
    path: Path
    fix: str


@dataclass(frozen=True)
class JobSpec:
    """One job to place."""

    name: str
    placement: Placement
    # Wall-clock limit: the ranks are stopped past it.
    timeout_min: int
    # A rank silent this long (launchers/heartbeat.py) is named and the job ended.
    heartbeat_timeout_s: float
    # The job saves checkpoints it can resume from: an engine may put it back in its queue when a
    # rank fell silent (its node failed) rather than end it.
    resumable: bool
    # Folders the ranks write in that must be the ones this process sees (an SQLite store, the
    # checkpoints): an engine whose nodes may not share this machine's disk checks them.
    shared_folders: tuple[SharedFolder, ...] = ()


@dataclass(frozen=True)
class MemoryBudget:
    """What each node gives a job's ranks, where the engine knows it before they start."""

    bytes: int
    # Shared by the node's ranks (CPU memory), or each rank's own (one GPU's).
    shared: bool
    # Where the figure comes from, for a refusal ("one GPU's memory", "launcher.mem_gb=64 per node").
    what: str


class PlacedJob(ABC):
    """A job whose ranks an engine placed."""

    # Where it runs, in a few words ("Slurm job 123"): the sweep board shows it beside the point.
    where: str = ""

    @abstractmethod
    def follow(self) -> Any:
        """Wait for the job's end, handing rank 0's output on; rank 0's result, or raise
        tasks.RankFailure (a rank raised, was killed or fell silent) or the engine's own error."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop every rank now (their runs end as interrupted)."""


class Launcher(ABC):
    """An engine. Its section's own keys are its `options` (a dataclass whose fields become keys of
    the `launcher` section beside the keys every engine reads); its instance holds the section."""

    name: ClassVar[str]
    options: ClassVar[type]
    # The folder of the job's folder its ranks' files go in (logs, results, heartbeats).
    folder_name: ClassVar[str]
    # The ranks run on the machine the job is launched from: they share its cores, GPUs and memory
    # with sweep points running beside them.
    on_this_machine: ClassVar[bool]
    # The engine may warn the ranks ahead of a stop (a signal before a time limit or a preemption):
    # they then agree at each step whether one came, and stop together.
    warns_before_stopping: ClassVar[bool] = False

    def __init__(self, section: Any):
        """`section`: the launcher section, the engine's options among its attributes."""
        self.section = section

    @staticmethod
    def environment_tags() -> dict[str, str]:
        """Run tags read in a rank from the engine's environment, whichever engine placed the rank
        (a local job started inside a Slurm allocation still has its job id); "" where unset."""
        return {}

    @abstractmethod
    def placement(self, request: PlacementRequest) -> Placement:
        """Where the ranks will run, every -1 and auto filled in; raises ConfigError."""

    def check_room(self, placement: Placement, oversubscribe: bool) -> None:
        """Whether the machine has room for the placed ranks, asked once the job is known to be
        well-formed (a refusal of its degrees says more than one of its size); raises ConfigError.
        An engine whose ranks run elsewhere leaves that to its scheduler."""
        return None

    def resolved_options(self, placement: Placement) -> dict[str, object]:
        """The engine's own keys whose -1 or auto the placement decides, with their values (the
        resolved config records them)."""
        return {}

    def memory_budget(self, placement: Placement) -> MemoryBudget | None:
        """What each node gives the ranks, where known before they start (None: not checked)."""
        return None

    def points_in_flight(self) -> int | None:
        """Sweep points placed away from this machine in flight at once (None: no limit but the room
        of this machine, for engines whose ranks run here)."""
        return None

    def described_only(self, spec: JobSpec, folder: Path) -> str | None:
        """What the engine is asked to show instead of placing the job (a batch script, not
        submitted); None where it places it."""
        return None

    def refusal(self, spec: JobSpec, folder: Path) -> str | None:
        """Why the engine would refuse this job, asked before anything is written (None: it takes it)."""
        return None

    @abstractmethod
    def place(
        self, target: Entrypoint, arg: Any, spec: JobSpec, folder: Path, echo: Callable[[str], None]
    ) -> PlacedJob | None:
        """Start target(arg) in each rank, their files under `folder`; None where the job is not to
        be followed (it runs on by itself)."""

    # From inside a rank this engine started:

    def restarted(self) -> bool:
        """Whether this process runs a job the engine started again (a requeue): it goes on with the
        same run."""
        return False

    def after_stop(self, stop: StopRequested, elapsed_s: float, can_resume: bool, job_dir: Path, is_rank0: bool) -> str:
        """What a stop request means for the job, once its ranks stopped together: raises Requeue
        where the engine puts the job back to resume from its checkpoint, else returns why it ends."""
        return f"{stop}; the ranks stopped after step {stop.step}"

    def leave_for_requeue(self, is_rank0: bool) -> None:
        """Leave this process of a job being put back in the engine's queue (it does not return)."""
        raise NotImplementedError(f"launcher={self.name} does not put jobs back")


class Requeue(Exception):
    """The engine puts the job back to resume from its checkpoint (Launcher.after_stop)."""

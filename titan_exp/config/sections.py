"""Config sections that belong to the job as a whole rather than to one component: the training
loop's (training, metrics, debug), placement's (launcher) and the parity run mode's.
Components' own sections sit next to their code (models/llama3/args.py, parallel/config.py,
optim/config.py, data/, quantize/, checkpoint/, tracking/). Key names are torchtitan's and torchrun's."""

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class TrainingConfig:
    steps: int = 50
    local_batch_size: int = 4
    # -1: local_batch_size × data-parallel degree (no gradient accumulation). A multiple of that
    # product accumulates gradients over global / (local × dp) microbatches per step.
    global_batch_size: int = -1
    seq_len: int = 256
    # Gradient clipping by total norm over all (possibly sharded) parameters; <= 0 turns it off.
    max_norm: float = 1.0
    # FSDP's MixedPrecisionPolicy; on a single device or DDP the param dtype becomes an autocast dtype.
    mixed_precision_param: str = "float32"
    mixed_precision_reduce: str = "float32"


@dataclass
class MetricsConfig:
    log_freq: int = 5


@dataclass
class DebugConfig:
    seed: int = 0
    deterministic: bool = False
    # real | fake_backend (one process stands in for rank 0 of the whole world) | local_tensor (every
    # TP rank's numbers in one process): see train/dry_run.py. COMM_MODE, when set, takes precedence.
    comm_mode: str = "real"


@dataclass
class LauncherConfig:
    """Where the rank processes run: this machine (`local`, or inside torchrun/srun) or a Slurm job
    that titan_exp submits (`slurm`; Slurm's own words for its keys). The resolved config
    (config/resolve.py) holds the real counts: no -1 and no `auto` is left for the ranks to work out."""

    # local | slurm
    name: str = "local"
    # -1: the product of the parallel degrees when none of them is -1; otherwise every visible GPU,
    # or 2 CPU ranks on a machine without one (slurm: launcher.gpus_per_node).
    nproc_per_node: int = -1
    nodes: int = 1
    # auto | cpu | cuda (slurm: auto means cuda unless launcher.gpus_per_node=0)
    device: str = "auto"
    # Wall-clock limit of the job (slurm: its --time); the ranks are killed past it.
    timeout_min: int = 24 * 60
    # Per-rank intra-op threads on CPU; -1: the host's cores shared evenly among the local ranks
    # (slurm: launcher.cpus_per_task, or 1).
    cpu_threads_per_rank: int = -1
    # Sweep points running side by side (-m): -1 as many as fit.
    max_parallel: int = -1
    # launcher=local on CPU: allow more ranks than this process has cores (they then time-share them;
    # fine for parity checks, meaningless for speed).
    oversubscribe: bool = False

    # launcher=slurm only.
    # -1: one GPU per rank with device=cuda, none with device=cpu.
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

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nodes


@dataclass
class ParityConfig:
    """experiment=loss_parity: a loss-parity comparison instead of one training job (job/parity.py)."""

    # Each entry: the overrides of one layout, e.g. "parallelism=fsdp launcher.nproc_per_node=2".
    # Empty: an ordinary training job. The first layout is the reference.
    layouts: list[str] = field(default_factory=list)
    # Largest relative deviation of a layout's loss from the reference's, at any step, that passes.
    rtol: float = 1e-4

"""Config sections that belong to the job as a whole rather than to one component: the training
loop's (training, metrics, debug), placement's (launcher) and the run modes' (parity, plan).
Components' own sections sit next to their code (models/config.py, parallel/config.py,
optim/config.py, data/, quantize/, checkpoint/, tracking/). Key names are torchtitan's and torchrun's."""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from launchers.heartbeat import BEAT_SECONDS
from launchers.slurm import SlurmOptions
from titan_exp.rules import (
    ConfigError,
    Section,
    check_at_least,
    check_choice,
    check_count_or_auto,
    check_in_range,
    check_one_line,
    check_positive,
    choices,
    one_of,
    torchtitan_name,
)

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class TrainingConfig(Section):
    # Optimizer steps of the run.
    steps: int = 50
    # Sequences per data-parallel rank per microbatch.
    local_batch_size: int = 4
    # -1: local_batch_size × data-parallel degree (no gradient accumulation). A multiple of that
    # product accumulates gradients over global / (local × dp) microbatches per step.
    global_batch_size: int = -1
    # Tokens per sequence.
    seq_len: int = 256
    # Gradient clipping by total norm over all (possibly sharded) parameters; <= 0 turns it off.
    max_norm: float = 1.0
    # Compute dtype of the parameters (FSDP's MixedPrecisionPolicy; an autocast dtype on a single
    # device or DDP) and of the gradient reduction.
    mixed_precision_param: str = one_of(*DTYPES)
    mixed_precision_reduce: str = one_of(*DTYPES)
    # torchtitan's names today: tokens per data-parallel rank per forward, tokens per step, the context.
    num_tokens_per_microbatch_per_dp_rank: Optional[int] = torchtitan_name(of="training.local_batch_size")
    num_tokens_per_train_step: Optional[int] = torchtitan_name(of="training.global_batch_size")
    max_context_length: Optional[int] = torchtitan_name(of="training.seq_len")

    def check(self, key: str) -> None:
        super().check(key)
        for name in ("steps", "seq_len", "local_batch_size"):
            check_positive(f"{key}.{name}", getattr(self, name))
        if math.isnan(self.max_norm) or math.isinf(self.max_norm):
            raise ConfigError(f"{key}.max_norm", self.max_norm, "must be a finite number (<= 0 turns clipping off)")


@dataclass
class ValidationConfig(Section):
    """A held-out loss during training, `loss/validation` (torchtitan's keys; train/validation.py)."""

    # Measure the loss on the held-out split every `freq` steps and at the last step.
    enable: bool = False
    freq: int = 10
    # Global batches of the held-out split per measurement, each as large as a training step's.
    steps: int = 1
    # The share of the data held out from training: the text corpus's last windows, data=files' documents
    # chosen by a hash of their place (the synthetic chain draws samples of its own for validation
    # and takes nothing from training).
    held_out_fraction: float = 0.05
    # data=files: the validation split read from these globs instead (nothing then held out).
    paths: list[str] = field(default_factory=list)

    def check(self, key: str) -> None:
        check_positive(f"{key}.freq", self.freq)
        if self.steps == -1:  # torchtitan's "the whole split": our splits are drawn without end
            raise ConfigError(f"{key}.steps", -1, "set a positive number of batches (the held-out split has no end)")
        check_positive(f"{key}.steps", self.steps)
        if not 0 < self.held_out_fraction < 1:  # also refuses nan
            raise ConfigError(f"{key}.held_out_fraction", self.held_out_fraction, "must lie in (0, 1)")


@dataclass
class MetricsConfig(Section):
    log_freq: int = 5

    def check(self, key: str) -> None:
        check_positive(f"{key}.log_freq", self.log_freq)


@dataclass
class DebugConfig(Section):
    # Seeds the weights' init and the data order on every rank.
    seed: int = 0
    deterministic: bool = False
    # real ranks, or a dry run in this one process: fake_backend (rank 0 of the whole world, any
    # size) | local_tensor (every TP rank's numbers). See train/dry_run.py; COMM_MODE takes precedence.
    comm_mode: str = one_of("real", "fake_backend", "local_tensor")

    def check(self, key: str) -> None:
        if not 0 <= self.seed < 2**63:  # what every generator the ranks seed takes
            raise ConfigError(f"{key}.seed", self.seed, "must be an integer in [0, 2**63)")
        # The environment's COMM_MODE may be where a wrong value came from.
        check_choice(f"{key}.comm_mode (or COMM_MODE)", self.comm_mode, choices(DebugConfig, "comm_mode"))


@dataclass
class _PlacementKeys(Section):
    """The launcher's keys every launcher reads (LauncherConfig's first keys)."""

    name: str = one_of("local", "slurm")
    # -1: the product of the parallel degrees when none of them is -1; otherwise every visible GPU,
    # or 2 CPU ranks on a machine without one (slurm: launcher.gpus_per_node).
    nproc_per_node: int = -1
    # Hosts of the job (launcher=slurm, or torchrun/srun's world).
    nodes: int = 1
    # Where the ranks compute; auto: cuda where there are GPUs (slurm: unless launcher.gpus_per_node=0).
    device: str = one_of("auto", "cpu", "cuda")
    # Wall-clock limit of the job (slurm: its --time); the ranks are killed past it.
    timeout_min: int = 24 * 60
    # A rank whose heartbeat (a thread of its own, every 2 s) stops this long is named and the job
    # stopped FAILED (a stopped or hung rank; its peers would wait in a collective until
    # comm.train_timeout_seconds). Watched by the launching process (launcher=slurm: while it waits).
    heartbeat_timeout_s: float = 60.0
    # Per-rank intra-op threads on CPU; -1: the host's cores shared evenly among the local ranks
    # (slurm: launcher.cpus_per_task, or 1).
    cpu_threads_per_rank: int = -1
    # Sweep points running side by side (-m): -1 as many as fit.
    max_parallel: int = -1
    # A sweep of more points is refused before it starts (-1: no limit).
    max_sweep_points: int = 64
    # launcher=local on CPU: allow more ranks than this process has cores (they then time-share them;
    # fine for parity checks, meaningless for speed).
    oversubscribe: bool = False


@dataclass
class LauncherConfig(SlurmOptions, _PlacementKeys):
    """Where the rank processes run: this machine (`local`, or inside torchrun/srun) or a Slurm job
    that titan_exp submits (`slurm`; Slurm's own words for its keys, declared in SlurmOptions). The
    resolved job holds the real counts (config/resolve.py): no -1 and no `auto` is left for the
    ranks to work out."""

    def check(self, key: str) -> None:
        super().check(key)
        check_count_or_auto(f"{key}.nproc_per_node", self.nproc_per_node, "auto")
        check_positive(f"{key}.timeout_min", self.timeout_min)
        check_at_least(f"{key}.heartbeat_timeout_s", self.heartbeat_timeout_s, 10 * BEAT_SECONDS)
        check_count_or_auto(f"{key}.max_parallel", self.max_parallel, "as many as fit")
        check_count_or_auto(f"{key}.max_sweep_points", self.max_sweep_points, "no limit")
        check_count_or_auto(f"{key}.cpu_threads_per_rank", self.cpu_threads_per_rank, "the cores shared evenly")
        if self.name == "slurm":
            self._check_slurm(key)
            return
        for name, default in slurm_defaults().items():
            if getattr(self, name) != default:
                raise ConfigError(
                    f"{key}.{name}", getattr(self, name), "is read by launcher=slurm only; add launcher=slurm"
                )

    def _check_slurm(self, key: str) -> None:
        check_positive(f"{key}.nodes", self.nodes)
        if not 0 <= self.signal_delay_s < 60 * self.timeout_min:
            raise ConfigError(
                f"{key}.signal_delay_s",
                self.signal_delay_s,
                f"must lie in [0, launcher.timeout_min × 60 = {60 * self.timeout_min}) seconds: "
                "the warning comes that long before the time limit",
            )
        check_at_least(f"{key}.max_num_timeout", self.max_num_timeout, 0)
        check_at_least(f"{key}.max_num_node_failures", self.max_num_node_failures, 0)
        check_positive(f"{key}.array_parallelism", self.array_parallelism)
        if self.gpus_per_node < -1:
            raise ConfigError(f"{key}.gpus_per_node", self.gpus_per_node, "must be >= 0 or -1 (one per rank)")
        for name in ("cpus_per_task", "mem_gb"):
            if getattr(self, name) is not None:
                check_positive(f"{key}.{name}", getattr(self, name))
        for name in ("partition", "account", "qos", "constraint", "srun_args", "additional_parameters"):
            check_one_line(f"{key}.{name}", getattr(self, name))

    def slurm_options(self) -> SlurmOptions:
        return SlurmOptions(**{name: getattr(self, name) for name in slurm_defaults()})


def slurm_defaults() -> dict[str, object]:
    """The keys only launcher=slurm reads, with their defaults."""
    defaults = SlurmOptions()
    return {f.name: getattr(defaults, f.name) for f in dataclasses.fields(SlurmOptions)}


@dataclass
class ParityConfig(Section):
    """experiment=loss_parity: a loss-parity comparison instead of one training job (job/parity.py)."""

    # Each entry: the overrides of one layout, e.g. "parallelism=fsdp launcher.nproc_per_node=2".
    # Empty: an ordinary training job. The first layout is the reference.
    layouts: list[str] = field(default_factory=list)
    # Largest relative deviation of a layout's loss from the reference's, at any step, that passes.
    rtol: float = 1e-4

    def check(self, key: str) -> None:
        check_in_range(f"{key}.rtol", self.rtol, 0.0, math.inf)


@dataclass
class PlanConfig(Section):
    """What `python -m titan_exp plan` and a sweep's pruning (plan/) do with the predictions."""

    # GiB a rank may use; None: the device's memory less `memory_margin`.
    memory_budget_gib: Optional[float] = None
    # Kept free of the device's memory for the allocator's fragmentation, the CUDA context, NCCL.
    memory_margin: float = 0.1
    # A training sweep (-m) skips the points predicted not to fit and records each as pruned.
    prune: bool = False
    # Measure rank 0's memory with the dry run's pass (fake process group, fake tensors: any size,
    # a few seconds) rather than model it; false: model everything (instant).
    measure: bool = True
    # MoE models: the busiest expert-parallel rank's routed tokens over the mean rank's (1.0:
    # balanced routing); its all-to-all and expert compute stretch by it. A run's
    # moe/load_imbalance (max/mean per expert) bounds it from above.
    expert_load_imbalance: float = 1.0

    def check(self, key: str) -> None:
        check_at_least(f"{key}.expert_load_imbalance", self.expert_load_imbalance, 1.0)
        if self.memory_budget_gib is not None:
            check_positive(f"{key}.memory_budget_gib", self.memory_budget_gib)
        if not 0 <= self.memory_margin < 1:  # also refuses nan
            raise ConfigError(
                f"{key}.memory_margin", self.memory_margin, "must lie in [0, 1): a fraction of the memory"
            )

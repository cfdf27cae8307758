"""Config sections that belong to the job as a whole rather than to one component: the training
loop's (training, metrics, debug), placement's (launcher) and the run modes' (parity, plan).
Components' own sections sit next to their code (models/config.py, parallel/config.py,
optim/config.py, data/, quantize/, checkpoint/, tracking/). Key names are torchtitan's and torchrun's."""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from launchers.base import Launcher
from launchers.heartbeat import BEAT_SECONDS
from launchers.registry import LAUNCHERS
from titan_exp.rules import (
    ConfigError,
    Section,
    check_at_least,
    check_choice,
    check_count_or_auto,
    check_in_range,
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
    # When data-parallel gradients are reduced under accumulation: after every microbatch (as
    # torchtitan: FSDP keeps only sharded gradients between microbatches), or after the last only
    # (one reduce-scatter or all-reduce a step, but FSDP then holds every unit's unsharded gradient,
    # in the reduce dtype, from the first microbatch to the last).
    gradient_sync: str = one_of("every_microbatch", "last_microbatch")
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
class LauncherConfig(Section):
    """Where the rank processes run: the keys every engine reads (`name` picks the engine: launchers/
    registry.py); each engine's option (conf/launcher/<name>.yaml) adds its own keys, declared
    beside the engine (its `options`). The resolved job holds the real counts (config/resolve.py):
    no -1 and no `auto` is left for the ranks to work out."""

    name: str = one_of(*LAUNCHERS)
    # -1: the product of the parallel degrees when none of them is -1; otherwise as the engine
    # counts a node's devices (launcher=local: every visible GPU, or 2 CPU ranks without one).
    nproc_per_node: int = -1
    # Hosts of the job (an engine that places several, or torchrun/srun's world).
    nodes: int = 1
    # Where the ranks compute; auto: cuda where there are GPUs.
    device: str = one_of("auto", "cpu", "cuda")
    # Wall-clock limit of the job; the ranks are stopped past it.
    timeout_min: int = 24 * 60
    # A rank whose heartbeat (a thread of its own, every 2 s) stops this long is named and the job
    # stopped FAILED (a stopped or hung rank; its peers would wait in a collective until
    # comm.train_timeout_seconds). Watched by the launching process while it follows the job.
    heartbeat_timeout_s: float = 60.0
    # Per-rank intra-op threads on CPU; -1: the engine's share of a node's cores.
    cpu_threads_per_rank: int = -1
    # Sweep points running side by side (-m): -1 as many as fit.
    max_parallel: int = -1
    # A sweep of more points is refused before it starts (-1: no limit).
    max_sweep_points: int = 64
    # CPU ranks on this machine: allow more ranks than this process has cores (they then time-share
    # them; fine for parity checks, meaningless for speed).
    oversubscribe: bool = False

    def check(self, key: str) -> None:
        super().check(key)
        check_count_or_auto(f"{key}.nproc_per_node", self.nproc_per_node, "auto")
        check_positive(f"{key}.timeout_min", self.timeout_min)
        check_at_least(f"{key}.heartbeat_timeout_s", self.heartbeat_timeout_s, 10 * BEAT_SECONDS)
        check_count_or_auto(f"{key}.max_parallel", self.max_parallel, "as many as fit")
        check_count_or_auto(f"{key}.max_sweep_points", self.max_sweep_points, "no limit")
        check_count_or_auto(f"{key}.cpu_threads_per_rank", self.cpu_threads_per_rank, "the cores shared evenly")
        if check_options := getattr(self, "check_options", None):  # the engine's own keys
            check_options()

    def engine(self) -> Launcher:
        """The engine this section names, holding it."""
        return LAUNCHERS[self.name](self)


def _engine_section(engine: type[Launcher]) -> type[LauncherConfig]:
    """An engine's section: the keys every engine reads (its name the default), then its own options."""
    name = f"{engine.name.title()}LauncherConfig"
    own_name = ("name", str, one_of(*LAUNCHERS, default=engine.name))
    return dataclasses.make_dataclass(
        name, [own_name], bases=(LauncherConfig, engine.options), namespace={"__module__": __name__}
    )


# The launcher group's option schemas (config/schema.py), by engine; module attributes by their
# names, so that a resolved job (pickled for its ranks and sweep points) finds its class again.
LAUNCHER_SECTIONS = {name: _engine_section(engine) for name, engine in LAUNCHERS.items()}
globals().update({section.__name__: section for section in LAUNCHER_SECTIONS.values()})


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
    # balanced routing); its all-to-all and expert compute stretch by it (no effect without EP). A
    # run's moe/load_imbalance (max/mean per expert) bounds it from above.
    expert_load_imbalance: float = 1.0
    # model.attn_mask_type=block_causal: the documents' mean length in tokens (attention's work
    # follows how many keys each query sees, within its document). None: measured from data.paths
    # (data=files: the first documents through its tokenizer), else as long as the window.
    document_tokens: Optional[float] = None
    # Predict a pipelined step that returns the last stage's outputs, as torch's schedules do by
    # default and torchtitan's did until 2025-10-22: every microbatch's logits stay on the last
    # stage until the step ends. titan_exp's own step returns none (parallel/pipeline.py).
    pipeline_returns_outputs: bool = False

    def check(self, key: str) -> None:
        check_at_least(f"{key}.expert_load_imbalance", self.expert_load_imbalance, 1.0)
        if self.document_tokens is not None:
            check_positive(f"{key}.document_tokens", self.document_tokens)
        if self.memory_budget_gib is not None:
            check_positive(f"{key}.memory_budget_gib", self.memory_budget_gib)
        if not 0 <= self.memory_margin < 1:  # also refuses nan
            raise ConfigError(
                f"{key}.memory_margin", self.memory_margin, "must lie in [0, 1): a fraction of the memory"
            )

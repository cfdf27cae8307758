"""Config sections read by the trainer (torchtitan's key names)."""

from dataclasses import dataclass


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
class OptimizerConfig:
    name: str = "AdamW"
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # foreach | fused | for-loop
    implementation: str = "foreach"


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 10
    # Fraction of the steps after warmup spent decaying; the rest stays flat at the peak (WSD).
    decay_ratio: float = 1.0
    # linear | sqrt | cosine
    decay_type: str = "cosine"
    # The LR decays to lr × min_lr_factor.
    min_lr_factor: float = 0.1


@dataclass
class ActivationCheckpointConfig:
    # none | full | selective
    mode: str = "none"
    # With mode=selective: "op" saves chosen op outputs in every block; an integer N checkpoints
    # every N-th block.
    selective_ac_option: str = "op"


@dataclass
class CompileConfig:
    enable: bool = False
    backend: str = "inductor"


@dataclass
class MetricsConfig:
    log_freq: int = 5


@dataclass
class DebugConfig:
    seed: int = 0
    deterministic: bool = False
    # real | fake_backend (one process stands in for rank 0 of the whole world: see dryrun.py).
    # The COMM_MODE environment variable, when set, takes precedence.
    comm_mode: str = "real"

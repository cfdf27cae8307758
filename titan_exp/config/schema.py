"""The typed run config: one dataclass per section, each defined next to the code that reads it,
assembled here and registered in Hydra's ConfigStore as the schema `conf/config.yaml` builds on."""

from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore

from launchers.config import LauncherConfig
from titan_exp.checkpoint.config import CheckpointConfig
from titan_exp.data.config import DataConfig
from titan_exp.models.llama3.args import Llama3Config
from titan_exp.parallel.config import ParallelismConfig
from titan_exp.parity_config import ParityConfig
from titan_exp.quantize.config import QuantizeConfig
from titan_exp.tracking.config import TrackingConfig
from titan_exp.train.config import (
    ActivationCheckpointConfig,
    CompileConfig,
    DebugConfig,
    LRSchedulerConfig,
    MetricsConfig,
    OptimizerConfig,
    TrainingConfig,
)


@dataclass
class ProfilingConfig:
    # No profiler hooks so far.
    name: str = "none"


@dataclass
class JobConfig:
    model: Llama3Config = field(default_factory=Llama3Config)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)


def register_schema() -> None:
    ConfigStore.instance().store(name="job_schema", node=JobConfig)


@dataclass(frozen=True)
class RunContext:
    """What the launching process tells the ranks besides the config."""

    # The Hydra run directory: composed config, overrides, rank logs.
    job_dir: str
    # local | torchrun | srun
    launcher: str

    @property
    def run_id_file(self) -> Path:
        """Where rank 0 records its MLflow run id, so the launching process can close a dead job's run."""
        return Path(self.job_dir) / "mlflow_run_id"

    @property
    def run_log_file(self) -> Path:
        """Rank 0's console output, logged with its MLflow run."""
        return Path(self.job_dir) / "rank0.log"

"""The typed run config: one dataclass per section, each defined next to the code that reads it
(with its own rules), assembled here and registered in Hydra's ConfigStore as the schema
`titan_exp/conf/config.yaml` builds on.

Torch-free, like everything the launching process imports (a test guards it)."""

import dataclasses
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from titan_exp.checkpoint.config import CheckpointConfig
from titan_exp.config.sections import (
    LAUNCHER_SECTIONS,
    DebugConfig,
    LauncherConfig,
    MetricsConfig,
    ParityConfig,
    PlanConfig,
    TrainingConfig,
    ValidationConfig,
)
from titan_exp.data.config import DataConfig
from titan_exp.estimate.config import HardwareConfig
from titan_exp.models.config import ModelConfig
from titan_exp.models.registry import FAMILIES, HF_OPTION, HFFolderConfig
from titan_exp.objective import SweepConfig
from titan_exp.optim.config import LRSchedulerConfig, OptimizerConfig
from titan_exp.parallel.config import ActivationCheckpointConfig, CommConfig, CompileConfig, ParallelismConfig
from titan_exp.profiling.config import ProfilingConfig
from titan_exp.quantize.config import QuantizeConfig
from titan_exp.rules import Section
from titan_exp.tracking.config import TrackingConfig

# Sections whose rules come before the others'.
FIRST_CHECKED = ("debug", "launcher")


@dataclass
class JobConfig(Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)

    def check(self, key: str = "") -> None:
        """Every section's own rules (rules across sections: config/check.py): how the job runs and
        where first, as a refusal names the first key that is wrong."""
        names = [f.name for f in dataclasses.fields(self)]
        for name in sorted(names, key=lambda name: name not in FIRST_CHECKED):
            getattr(self, name).check(name)


def option_schemas() -> dict[str, dict[str, type[Section]]]:
    """The groups whose options build on a section of their own (a subclass of the group's
    section: a model family's, or model=hf's with every family's keys, models/registry.py; an
    engine's, launchers/registry.py): each option names its schema first in its defaults list,
    `- /<group>_schema/<name>@_here_`."""
    return {
        "model": {name: family.config for name, family in FAMILIES.items()} | {HF_OPTION: HFFolderConfig},
        "launcher": LAUNCHER_SECTIONS,
    }


def register_schema() -> None:
    store = ConfigStore.instance()
    store.store(name="job_schema", node=JobConfig)
    for group, schemas in option_schemas().items():
        for name, node in schemas.items():
            store.store(group=f"{group}_schema", name=name, node=node)

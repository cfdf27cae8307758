"""The resolved job: what `resolve` (config/resolve.py) makes of a composed config, once, in the
launching process, and what every later step receives as it is (the pre-flight, the launcher, each
rank, each sweep point): the frozen, filled-in config, its parallel degrees, where the ranks run and
the tracking store. Its name and tags in MLflow are derived from it here, and nowhere else."""

import dataclasses
from dataclasses import dataclass

from omegaconf import OmegaConf

from launchers.base import Launcher, Placement
from launchers.devices import threads_per_rank
from launchers.registry import environment_tags
from titan_exp.config.schema import JobConfig
from titan_exp.config.unread import unread_keys
from titan_exp.parallel.dims import ParallelDims
from titan_exp.rules import dotted_keys
from titan_exp.tracking.config import Store


@dataclass(frozen=True)
class Resume:
    """Where a job resumes from a checkpoint: its step, and what the job changes from the job that
    saved it, one line each (job/resume.py), which rank 0 prints and records with its run."""

    step: int
    lines: tuple[str, ...]


@dataclass(frozen=True)
class ResolvedJob:
    config: JobConfig  # frozen: nothing downstream changes what was resolved
    dims: ParallelDims
    placement: Placement
    resume: Resume | None = None  # None: the job starts afresh

    @property
    def store(self) -> Store | None:
        """The tracking store, parsed once (None when tracking is off)."""
        return self.config.tracking.store if self.config.tracking.enable else None

    @property
    def dry_run(self) -> bool:
        """COMM_MODE=fake_backend or local_tensor: this process plays the ranks (train/dry_run.py)."""
        return self.config.debug.comm_mode != "real"

    @property
    def launcher(self) -> Launcher:
        """The engine that places the ranks (launchers/registry.py)."""
        return self.config.launcher.engine()

    @property
    def unread_keys(self) -> list[str]:
        """The keys this layout does not read, whatever their values (config/unread.py)."""
        return [key for key, _ in unread_keys(self.config, self.dims)]

    @property
    def tokens_per_step(self) -> int:
        """The tokens of one optimizer step, over every data-parallel rank (global batch × seq_len)."""
        t = self.config.training
        return t.global_batch_size * t.seq_len

    @property
    def accumulation(self) -> int:
        """Microbatches whose gradients accumulate into one step."""
        t = self.config.training
        return t.global_batch_size // (t.local_batch_size * self.dims.dp)

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches that flow through the pipeline's stages per local batch."""
        t = self.config.training
        return t.local_batch_size // self.config.parallelism.pipeline_parallel_microbatch_size

    def with_parent_run(self, run_id: str) -> "ResolvedJob":
        """The same job, its MLflow run a child of `run_id` (a sweep's parent run)."""
        return self.replaced(tracking={"parent_run_id": run_id})

    def replaced(self, **sections: dict[str, object]) -> "ResolvedJob":
        """The same job with keys of its sections changed, e.g. replaced(model={"n_layers": 2}): for
        changes that keep its degrees and placement (a sweep's parent run, the planner's smaller
        variants of a model)."""
        return dataclasses.replace(self, config=changed_config(self.config, **sections))

    def on_cores(self, cores: int) -> "ResolvedJob":
        """The same job given `cores` cores of this machine (a sweep point beside others): each CPU
        rank gets an equal share as its threads."""
        threads = threads_per_rank(cores, self.placement.nproc_per_node)
        placement = dataclasses.replace(self.placement, threads_per_rank=threads)
        job = self.replaced(launcher={"cpu_threads_per_rank": threads})
        return dataclasses.replace(job, placement=placement)

    def run_name(self) -> str:
        """The model, the layout and every choice that changes how it runs, e.g. <model>_debug·fsdp2,
        <model>_8b·fsdp8·tp2·float8·ac_full·compile, <model>_debug·pp2·Interleaved1F1B·4mb: the runs
        of a sweep over any of them are told apart by name (tracking.run_name wins when set)."""
        cfg = self.config
        if cfg.tracking.run_name:
            return cfg.tracking.run_name
        parts = [self.model_name, self.dims.label()]
        if self.dims.pp > 1:
            parts += [cfg.parallelism.pipeline_parallel_schedule, f"{self.pipeline_microbatches}mb"]
        if cfg.quantize.name != "none":
            parts.append(cfg.quantize.name)
        if cfg.activation_checkpoint.mode != "none":
            parts.append(f"ac_{cfg.activation_checkpoint.mode}")
        if cfg.compile.enable:
            parts.append("compile")
        return "·".join(parts)

    @property
    def model_name(self) -> str:
        return f"{self.config.model.name}_{self.config.model.flavor}"

    def run_tags(self, started_by: str) -> dict[str, str]:
        """Tags of the job's run; `started_by`: who started the ranks (RunContext.started_by, or plan)."""
        cfg = self.config
        return {
            "model": self.model_name,
            "strategy": cfg.parallelism.name,
            "quantize": cfg.quantize.name,
            "layout": self.dims.label(),
            "world_size": str(self.dims.world_size),
            "mesh": self.dims.describe(),
            "device": self.placement.device,
            "launcher": started_by,
            **environment_tags(),
            "status": "running",
            "layout_key": self.layout_key(),
        }

    def layout_key(self) -> str:
        """What a prediction and a training run must share to be compared (python -m titan_exp plan):
        the model, the layout, the batch's shape, precision and the memory-saving options."""
        p, t = self.config.parallelism, self.config.training
        parts = [
            self.model_name,
            self.dims.label(),
            f"batch{t.local_batch_size}x{t.seq_len}/{t.global_batch_size}",
            t.mixed_precision_param,
            f"ac-{self.config.activation_checkpoint.mode}",
            self.config.quantize.name,
        ]
        if self.dims.pp > 1:
            parts.append(f"{p.pipeline_parallel_schedule}-mb{p.pipeline_parallel_microbatch_size}")
        return "·".join(parts)

    def params(self) -> dict[str, object]:
        """The resolved config as MLflow params: {'training.steps': 50, ...}."""
        return dotted_keys(OmegaConf.to_container(OmegaConf.structured(self.config)))

    def layout_params(self) -> dict[str, object]:
        """The params beside the config (`derived/`) that its layout decides: what a resume into
        another layout changes (rank 0 logs them with what it measures, train/leader.py)."""
        return {
            "derived/mesh": self.dims.describe(),
            "derived/world_size": self.dims.world_size,
            "derived/global_batch_tokens": self.tokens_per_step,
            "derived/gradient_accumulation_steps": self.accumulation,
        }


def changed_config(cfg: JobConfig, **sections: dict[str, object]) -> JobConfig:
    """A new config with keys of its sections changed (frozen if `cfg` is)."""
    changes = {name: dataclasses.replace(getattr(cfg, name), **values) for name, values in sections.items()}
    changed = dataclasses.replace(cfg, **changes)
    if cfg._frozen:
        changed.freeze()
    return changed

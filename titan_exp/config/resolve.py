"""From a composed config to the resolved job (config/job.py), once, in the launching process:
every rule checked (each section's own, then those across sections: config/check.py), and
nothing left to infer. Worked out here: the comm mode (COMM_MODE), the placement (the engine's,
launchers/: rank counts, the device with no `auto`, CPU threads per rank), the degrees (the one
-1), the context-parallel attention, the global batch, absolute paths (ranks may start in another
directory) and the tracking store. What touches the disk, the network or the memory estimate is
the pre-flight's (job/preflight.py)."""

import copy
import math
import os
from operator import attrgetter
from pathlib import Path

from launchers.base import Placement, PlacementRequest, check_one_line
from launchers.devices import cpu_cores, threads_per_rank
from launchers.env import external_launcher
from titan_exp.checkpoint.config import OWN_FOLDER, own_folder
from titan_exp.config import check
from titan_exp.config.aliases import apply_aliases
from titan_exp.config.job import ResolvedJob
from titan_exp.config.schema import JobConfig
from titan_exp.models.registry import HF_OPTION, config_from_hf
from titan_exp.parallel.config import resolved_context_parallel_impl
from titan_exp.parallel.dims import ParallelDims
from titan_exp.rules import ConfigError


def resolve(cfg: JobConfig, place: bool = True, job_dir: Path | None = None, room: bool = True) -> ResolvedJob:
    """The resolved job of `cfg`; raises ConfigError before anything starts. `place=False` (the
    planner's): resolved as for a dry run, the world as the launcher spells it out, placed nowhere.
    `job_dir`: the job's folder, where its own checkpoints go (none: a job that is not run).
    `room=False`: placed without asking whether this machine has room for it (`show`)."""
    if job_dir is not None:  # it reaches logs, a Slurm script and the ranks' command lines
        check_one_line("hydra.run.dir", str(job_dir))
    cfg = copy.deepcopy(cfg)
    apply_aliases(cfg)
    _model_from_hf(cfg)
    cfg.debug.comm_mode = os.environ.get("COMM_MODE") or cfg.debug.comm_mode
    cfg.check()
    placement = _place(cfg) if place and cfg.debug.comm_mode == "real" else _place_nowhere(cfg)
    dims = ParallelDims.resolve(cfg.parallelism, placement.world_size)
    _fill_in(cfg, placement, dims, job_dir)
    check.check_job(cfg, dims, placement, placed=place)
    if place and room and cfg.debug.comm_mode == "real":
        cfg.launcher.engine().check_room(placement, cfg.launcher.oversubscribe)
    cfg.freeze()
    return ResolvedJob(cfg, dims, placement)


def _model_from_hf(cfg: JobConfig) -> None:
    """model=hf: the model section of model.hf_path's config.json, its family's, with the keys set
    beside model=hf over it (read here, not in the pre-flight: every rule after this one depends on
    the model's shape)."""
    model = cfg.model
    if model.name != HF_OPTION:
        if model.hf_path is not None:
            raise ConfigError("model.hf_path", model.hf_path, "is read by model=hf only; add model=hf")
        return
    if model.hf_path is None:
        raise ConfigError("model.hf_path", None, "model=hf takes its shape from a Hugging Face model folder; set it")
    folder = Path(model.hf_path).resolve()
    check_one_line("model.hf_path", str(folder))  # its name becomes the run's, printed and logged
    keys_set = {key: attrgetter(key)(model) for key in getattr(model, "keys_set", ())}
    cfg.model = config_from_hf(str(folder), "model.hf_path", keys_set)
    cfg.model.flavor = folder.name


def _place(cfg: JobConfig) -> Placement:
    """The engine's placement (launchers/), its own keys' -1 and auto filled in."""
    launcher = cfg.launcher
    degrees = cfg.parallelism.degrees().values()
    request = PlacementRequest(
        nproc_per_node=launcher.nproc_per_node,
        nodes=launcher.nodes,
        device=launcher.device,
        cpu_threads_per_rank=launcher.cpu_threads_per_rank,
        oversubscribe=launcher.oversubscribe,
        degrees_product=None if -1 in degrees else math.prod(degrees),
        started_by=external_launcher(),
    )
    engine = launcher.engine()
    placement = engine.placement(request)
    for key, value in engine.resolved_options(placement).items():
        setattr(launcher, key, value)
    return placement


def _place_nowhere(cfg: JobConfig) -> Placement:
    """A dry run (or a plan) is one process on this CPU playing rank 0 of the world the launcher spells out."""
    launcher = cfg.launcher
    if launcher.nproc_per_node == -1:
        raise ConfigError(
            "launcher.nproc_per_node",
            -1,
            "a dry run needs the world spelled out: set launcher.nproc_per_node (and launcher.nodes)",
        )
    threads = launcher.cpu_threads_per_rank
    threads = threads if threads > 0 else threads_per_rank(cpu_cores(), launcher.nproc_per_node)
    return Placement(None, "cpu", launcher.nproc_per_node, launcher.nodes, threads)


def _fill_in(cfg: JobConfig, placement: Placement, dims: ParallelDims, job_dir: Path | None) -> None:
    """The config as a record of what was resolved (it is logged with the run): no -1, no auto."""
    launcher = cfg.launcher
    launcher.nproc_per_node, launcher.nodes = placement.nproc_per_node, placement.nodes
    launcher.device, launcher.cpu_threads_per_rank = placement.device, placement.threads_per_rank
    for key, degree in dims.degrees().items():
        setattr(cfg.parallelism, key, degree)
    p = cfg.parallelism
    p.context_parallel_impl = resolved_context_parallel_impl(p.context_parallel_impl, placement.device)
    if cfg.training.global_batch_size == -1:
        cfg.training.global_batch_size = cfg.training.local_batch_size * dims.dp
    cfg.data.cache_dir = str(Path(cfg.data.cache_dir).resolve())
    if cfg.checkpoint.folder != OWN_FOLDER:
        cfg.checkpoint.folder = str(Path(cfg.checkpoint.folder).resolve())
    elif job_dir is not None:
        cfg.checkpoint.folder = own_folder(job_dir)
    if cfg.checkpoint.initial_load_path:
        cfg.checkpoint.initial_load_path = str(Path(cfg.checkpoint.initial_load_path).resolve())
    if cfg.tracking.enable:
        cfg.tracking.uri = cfg.tracking.store.uri

"""From a composed config to the resolved job (config/job.py), once, in the launching process:
every rule checked (each section's own, then those across sections: config/check.py), and
nothing left to infer. Worked out here: the comm mode (COMM_MODE), the placement (rank counts from
the degrees, the GPUs, or torchrun/srun's environment; the device, no `auto`; CPU threads per
rank), the degrees (the one -1), the context-parallel attention, the global batch, absolute paths
(ranks may start in another directory) and the tracking store. What touches the disk, the network
or the memory estimate is the pre-flight's (job/preflight.py)."""

import copy
import math
import os
from pathlib import Path

from launchers.devices import cpu_cores, visible_gpus
from launchers.env import RankEnv, external_launcher
from titan_exp.config import check
from titan_exp.config.aliases import apply_aliases
from titan_exp.config.job import Placement, ResolvedJob, threads_per_rank
from titan_exp.config.schema import JobConfig
from titan_exp.models.registry import config_from_hf
from titan_exp.parallel.config import resolved_context_parallel_impl
from titan_exp.parallel.dims import ParallelDims
from titan_exp.rules import ConfigError

# Ranks on a machine without GPUs when neither the launcher nor the degrees say how many.
DEFAULT_CPU_RANKS = 2


def resolve(cfg: JobConfig, place: bool = True) -> ResolvedJob:
    """The resolved job of `cfg`; raises ConfigError before anything starts. `place=False` (the
    planner's): resolved as for a dry run, the world as the launcher spells it out, placed nowhere."""
    cfg = copy.deepcopy(cfg)
    apply_aliases(cfg)
    _model_from_hf(cfg)
    cfg.debug.comm_mode = os.environ.get("COMM_MODE") or cfg.debug.comm_mode
    cfg.check()
    placement = _place(cfg) if place and cfg.debug.comm_mode == "real" else _place_nowhere(cfg)
    dims = ParallelDims.resolve(cfg.parallelism, placement.world_size)
    _fill_in(cfg, placement, dims)
    check.check_job(cfg, dims, placement, placed=place)
    if place and cfg.debug.comm_mode == "real" and _spawns_cpu_ranks_here(cfg, placement):
        check.check_cpu_ranks(cfg.launcher, placement.nproc_per_node, cpu_cores())
    cfg.freeze()
    return ResolvedJob(cfg, dims, placement)


def _model_from_hf(cfg: JobConfig) -> None:
    """model=hf: the model section of model.hf_path's config.json, its family's (read here, not in
    the pre-flight: every rule after this one depends on the model's shape)."""
    model = cfg.model
    if model.name != "hf":
        if model.hf_path is not None:
            raise ConfigError("model.hf_path", model.hf_path, "is read by model=hf only; add model=hf")
        return
    if model.hf_path is None:
        raise ConfigError("model.hf_path", None, "model=hf takes its shape from a Hugging Face model folder; set it")
    folder = Path(model.hf_path).resolve()
    cfg.model = config_from_hf(str(folder), "model.hf_path")
    cfg.model.flavor = folder.name


def _spawns_cpu_ranks_here(cfg: JobConfig, placement: Placement) -> bool:
    return cfg.launcher.name == "local" and placement.device == "cpu" and placement.started_by is None


def _place(cfg: JobConfig) -> Placement:
    started_by = external_launcher()
    check.check_started_by(cfg.launcher, started_by)
    if cfg.launcher.name == "slurm":
        return _place_on_slurm(cfg)
    return _place_here(cfg, started_by)


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


def _place_here(cfg: JobConfig, started_by: str | None) -> Placement:
    """On this machine: our launcher's ranks, or this process as one rank of torchrun's or srun's."""
    launcher = cfg.launcher
    gpus = visible_gpus() if launcher.device != "cpu" else 0
    if started_by:
        env = RankEnv.from_environ()
        nproc, nodes = env.local_world_size, env.world_size // env.local_world_size
    else:
        nproc, nodes = _ranks_per_node(cfg, gpus), launcher.nodes
    check.check_gpus(launcher, nproc, gpus, spawned_here=started_by is None)
    device = "cuda" if gpus and launcher.device != "cpu" else "cpu"
    threads = launcher.cpu_threads_per_rank
    if threads == -1:
        # torchrun and srun set OMP_NUM_THREADS for their ranks; our launcher shares the cores out.
        inherited = os.environ.get("OMP_NUM_THREADS") if started_by else None
        threads = int(inherited) if inherited else threads_per_rank(cpu_cores(), nproc)
    return Placement(started_by, device, nproc, nodes, threads)


def _place_on_slurm(cfg: JobConfig) -> Placement:
    """A Slurm job's nodes are not this machine: counts come from the config alone. Ranks per node:
    launcher.nproc_per_node, else one per GPU of launcher.gpus_per_node, else the degrees' product
    over the nodes; device auto is cuda unless launcher.gpus_per_node=0. The resolved GPUs per node
    are written into the launcher section."""
    launcher = cfg.launcher
    degrees = cfg.parallelism.degrees().values()
    degrees_product = None if -1 in degrees else math.prod(degrees)
    check.check_slurm_ranks(launcher, degrees_product)
    device = launcher.device
    if device == "auto":
        device = "cpu" if launcher.gpus_per_node == 0 else "cuda"
    nproc = launcher.nproc_per_node
    if nproc == -1:
        gpus = launcher.gpus_per_node
        nproc = gpus if gpus > 0 else degrees_product // launcher.nodes
    if launcher.gpus_per_node == -1:
        launcher.gpus_per_node = nproc if device == "cuda" else 0
    threads = launcher.cpu_threads_per_rank
    if threads == -1:
        threads = launcher.cpus_per_task or 1
    return Placement(None, device, nproc, launcher.nodes, threads)


def _ranks_per_node(cfg: JobConfig, gpus: int) -> int:
    """launcher.nproc_per_node, or for -1: the degrees' product when none is -1, else one rank per
    visible GPU, else DEFAULT_CPU_RANKS."""
    if cfg.launcher.nproc_per_node != -1:
        return cfg.launcher.nproc_per_node
    degrees = cfg.parallelism.degrees().values()
    if -1 not in degrees:
        return math.prod(degrees)
    return gpus or DEFAULT_CPU_RANKS


def _fill_in(cfg: JobConfig, placement: Placement, dims: ParallelDims) -> None:
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
    cfg.checkpoint.folder = str(Path(cfg.checkpoint.folder).resolve())
    if cfg.checkpoint.initial_load_path:
        cfg.checkpoint.initial_load_path = str(Path(cfg.checkpoint.initial_load_path).resolve())
    if cfg.tracking.enable:
        cfg.tracking.uri = cfg.tracking.store.uri

"""From a composed config to the one the ranks receive: checked (config/check.py) and with nothing
left to infer. Filled in here: the comm mode (COMM_MODE), the rank counts (`launcher.nproc_per_node`,
`launcher.nodes`: from the degrees, the GPUs, or torchrun/srun's environment), the device (no
`auto`), CPU threads per rank, the one -1 degree, the global batch, and absolute paths (ranks may
start in another directory)."""

import copy
import math
import os
from pathlib import Path

from launchers.devices import available_memory, cpu_cores, gpu_memory, visible_gpus
from launchers.env import RankEnv, external_launcher
from titan_exp.config import check
from titan_exp.config.schema import JobConfig
from titan_exp.estimate.memory import GIB, RankMemory, rank_memory
from titan_exp.parallel.config import resolved_context_parallel_impl
from titan_exp.tracking.store import absolute_uri

# Ranks on a machine without GPUs when neither the launcher nor the degrees say how many.
DEFAULT_CPU_RANKS = 2


def resolve(cfg: JobConfig) -> JobConfig:
    """A checked, filled-in copy of `cfg`; raises ConfigError before anything starts."""
    cfg = copy.deepcopy(cfg)
    cfg.debug.comm_mode = os.environ.get("COMM_MODE") or cfg.debug.comm_mode
    check.check_comm_mode(cfg.debug.comm_mode)
    if cfg.debug.comm_mode == "real":
        _place(cfg)
    else:
        # A dry run is one process on this CPU playing rank 0 of the world the launcher spells out.
        check.check_launcher(cfg.launcher, started_by=None, dry_run=True)
        check.check_dry_run_world(cfg.launcher)
        cfg.launcher.device = "cpu"
    _fill_degrees(cfg)
    p = cfg.parallelism
    p.context_parallel_impl = resolved_context_parallel_impl(p.context_parallel_impl, cfg.launcher.device)
    check.check_job(cfg)
    if cfg.debug.comm_mode == "real":
        check.check_cuda_only_features(cfg)
        _check_resources(cfg)
    elif cfg.debug.comm_mode == "local_tensor":
        check.check_local_tensor_layout(cfg)
    if cfg.training.global_batch_size == -1:
        p = cfg.parallelism
        cfg.training.global_batch_size = (
            cfg.training.local_batch_size * p.data_parallel_replicate_degree * p.data_parallel_shard_degree
        )
    _make_paths_absolute(cfg)
    return cfg


def _place(cfg: JobConfig) -> None:
    """Rank counts, device and threads of a real job, written into cfg.launcher."""
    started_by = external_launcher()
    check.check_launcher(cfg.launcher, started_by)
    if cfg.launcher.name == "slurm":
        _place_on_slurm(cfg)
    else:
        _place_here(cfg, started_by)


def _place_here(cfg: JobConfig, started_by: str | None) -> None:
    """On this machine: our launcher's ranks, or this process as one rank of torchrun's or srun's."""
    launcher = cfg.launcher
    gpus = visible_gpus() if launcher.device != "cpu" else 0
    if started_by:
        env = RankEnv.from_environ()
        nproc, nodes = env.local_world_size, env.world_size // env.local_world_size
    else:
        nproc, nodes = _ranks_per_node(cfg, gpus), launcher.nodes
    check.check_gpus(launcher, nproc, gpus, spawned_here=started_by is None)
    launcher.nproc_per_node, launcher.nodes = nproc, nodes
    launcher.device = "cuda" if gpus and launcher.device != "cpu" else "cpu"
    if launcher.cpu_threads_per_rank == -1:
        # torchrun and srun set OMP_NUM_THREADS for their ranks; our launcher shares the cores out.
        inherited = os.environ.get("OMP_NUM_THREADS") if started_by else None
        launcher.cpu_threads_per_rank = int(inherited) if inherited else max(1, cpu_cores() // nproc)


def _place_on_slurm(cfg: JobConfig) -> None:
    """A Slurm job's nodes are not this machine: counts come from the config alone. Ranks per node:
    launcher.nproc_per_node, else one per GPU of launcher.gpus_per_node, else the degrees' product
    over the nodes; device auto is cuda unless launcher.gpus_per_node=0."""
    launcher = cfg.launcher
    degrees = cfg.parallelism.degrees().values()
    degrees_product = None if -1 in degrees else math.prod(degrees)
    check.check_slurm_ranks(launcher, degrees_product)
    if launcher.device == "auto":
        launcher.device = "cpu" if launcher.gpus_per_node == 0 else "cuda"
    if launcher.nproc_per_node == -1:
        gpus = launcher.gpus_per_node
        launcher.nproc_per_node = gpus if gpus > 0 else degrees_product // launcher.nodes
    if launcher.gpus_per_node == -1:
        launcher.gpus_per_node = launcher.nproc_per_node if launcher.device == "cuda" else 0
    if launcher.cpu_threads_per_rank == -1:
        launcher.cpu_threads_per_rank = launcher.cpus_per_task or 1


def _check_resources(cfg: JobConfig) -> None:
    """After every rule of the config itself: what the ranks need against what they can have, where
    that is known from here. Our launcher's CPU ranks get a core each (unless oversubscribing);
    one rank's estimated peak memory fits in a GPU, in the available memory shared by the CPU ranks,
    or in a Slurm CPU job's launcher.mem_gb per node. Ranks that torchrun or srun started share the
    node with siblings already allocating: not checked there."""
    launcher, started_by = cfg.launcher, external_launcher()
    if launcher.name == "local" and launcher.device == "cpu" and not started_by:
        check.check_cpu_ranks(launcher, launcher.nproc_per_node, cpu_cores())
    if launcher.name == "slurm":
        if launcher.device != "cpu" or launcher.mem_gb is None:
            return
        budget, where = launcher.mem_gb * GIB / launcher.nproc_per_node, f"launcher.mem_gb={launcher.mem_gb:g} per node"
    elif started_by:
        return
    elif launcher.device == "cuda":
        budget, where = gpu_memory(), "one GPU's memory"
    else:
        available, ranks = available_memory(), launcher.nproc_per_node
        budget = available / ranks if available is not None else None
        where = f"{(available or 0) / GIB:.1f} GiB available on this machine"
        where += f" for {ranks} ranks" if ranks > 1 else ""
    if budget is not None:
        check.check_memory_fit(cfg, _rank_memory, int(budget), where)


def _rank_memory(cfg: JobConfig) -> RankMemory:
    t = cfg.training
    return rank_memory(
        cfg.model,
        cfg.parallelism,
        t.local_batch_size,
        t.seq_len,
        t.mixed_precision_param,
        cfg.activation_checkpoint,
        on_cpu=cfg.launcher.device == "cpu",
    )


def _ranks_per_node(cfg: JobConfig, gpus: int) -> int:
    """launcher.nproc_per_node, or for -1: the degrees' product when none is -1, else one rank per
    visible GPU, else DEFAULT_CPU_RANKS."""
    if cfg.launcher.nproc_per_node != -1:
        return cfg.launcher.nproc_per_node
    degrees = cfg.parallelism.degrees().values()
    if -1 not in degrees:
        return math.prod(degrees)
    return gpus or DEFAULT_CPU_RANKS


def _fill_degrees(cfg: JobConfig) -> None:
    """The (at most one) -1 degree takes what the others leave of the world size."""
    world_size = cfg.launcher.world_size
    degrees = cfg.parallelism.degrees()
    check.check_degrees(degrees, world_size)
    for key, degree in degrees.items():
        if degree == -1:
            others = math.prod(d for d in degrees.values() if d != -1)
            setattr(cfg.parallelism, key, world_size // others)


def _make_paths_absolute(cfg: JobConfig) -> None:
    cfg.data.cache_dir = str(Path(cfg.data.cache_dir).resolve())
    cfg.checkpoint.folder = str(Path(cfg.checkpoint.folder).resolve())
    if cfg.checkpoint.initial_load_path:
        cfg.checkpoint.initial_load_path = str(Path(cfg.checkpoint.initial_load_path).resolve())
    if cfg.tracking.enable:
        cfg.tracking.uri = absolute_uri(cfg.tracking.uri)

"""config/resolve.py: the config the ranks receive has nothing left to infer, whoever places them."""

import dataclasses

import pytest
from omegaconf import OmegaConf

from launchers.devices import cpu_cores
from launchers.slurm import SlurmOptions
from titan_exp.config.resolve import resolve

from conftest import compose_config


def resolved(overrides: list[str]):
    """The resolved job's config (the record of what was resolved)."""
    return resolve(OmegaConf.to_object(compose_config(overrides))).config


# Keys a local job's ranks never read: a sweep's (max_parallel) and launcher=slurm's.
NOT_READ_BY_LOCAL_RANKS = {"max_parallel", *(f.name for f in dataclasses.fields(SlurmOptions))}


def _left_open(section) -> list[str]:
    """Fields still -1 or 'auto' that a local job's ranks read."""
    names = [f.name for f in dataclasses.fields(section) if f.name not in NOT_READ_BY_LOCAL_RANKS]
    return [name for name in names if getattr(section, name) in (-1, "auto")]


@pytest.mark.parametrize(
    "overrides,nproc",
    [
        (["parallelism=fsdp"], 2),  # a -1 degree, no GPU: DEFAULT_CPU_RANKS
        (["parallelism=fsdp_tp", "parallelism.data_parallel_shard_degree=2", "launcher.oversubscribe=true"], 4),
        (["parallelism=hsdp", "launcher.nproc_per_node=4", "launcher.oversubscribe=true"], 4),
        (["parallelism=single"], 1),
    ],
)
def test_local_launch_writes_back_counts_device_and_threads(placement_env, overrides, nproc):
    cfg = resolved(overrides)
    assert (cfg.launcher.nproc_per_node, cfg.launcher.nodes, cfg.launcher.device) == (nproc, 1, "cpu")
    assert cfg.launcher.cpu_threads_per_rank == max(1, cpu_cores() // nproc)
    assert cfg.training.global_batch_size > 0 and cfg.debug.comm_mode == "real"
    for section in (cfg.launcher, cfg.parallelism, cfg.training):
        assert _left_open(section) == [], section


def test_torchrun_world_comes_from_its_environment(placement_env):
    placement_env(RANK=5, LOCAL_RANK=1, WORLD_SIZE=8, LOCAL_WORLD_SIZE=4, TORCHELASTIC_RUN_ID="x", OMP_NUM_THREADS=3)
    cfg = resolved(["parallelism=fsdp_tp", "parallelism.tensor_parallel_degree=2"])
    assert (cfg.launcher.nproc_per_node, cfg.launcher.nodes, cfg.launcher.nproc_per_node * cfg.launcher.nodes) == (
        4,
        2,
        8,
    )
    assert (cfg.parallelism.data_parallel_shard_degree, cfg.parallelism.tensor_parallel_degree) == (4, 2)
    assert cfg.launcher.cpu_threads_per_rank == 3  # torchrun's OMP_NUM_THREADS, not a share of the cores


def test_srun_world_comes_from_slurm_variables_on_any_node(placement_env):
    # The second of 2 nodes × 8 tasks: rank 12 is its local rank 4.
    placement_env(
        SLURM_STEP_ID=0, SLURM_JOB_ID=77, SLURM_NTASKS=16, SLURM_PROCID=12, SLURM_LOCALID=4, SLURM_NODEID=1,
        SLURM_STEP_TASKS_PER_NODE="8(x2)", SLURM_JOB_NODELIST="node[1-2]",
    )  # fmt: skip
    cfg = resolved(["parallelism=fsdp"])
    assert (cfg.launcher.nproc_per_node, cfg.launcher.nodes) == (8, 2)
    assert cfg.parallelism.data_parallel_shard_degree == 16


def test_dry_run_takes_the_world_as_spelled_out(placement_env):
    placement_env(COMM_MODE="fake_backend")
    cfg = resolved(
        [
            "parallelism=fsdp_tp",
            "parallelism.tensor_parallel_degree=4",
            "launcher.nodes=64",
            "launcher.nproc_per_node=8",
        ]
    )
    assert cfg.debug.comm_mode == "fake_backend" and cfg.launcher.device == "cpu"
    assert cfg.launcher.nproc_per_node * cfg.launcher.nodes == 512 and cfg.parallelism.data_parallel_shard_degree == 128


def test_paths_become_absolute(placement_env, tmp_path):
    cfg = resolved(["tracking.uri=sqlite:///outputs/x.db", "data.cache_dir=outputs/cache"])
    assert cfg.tracking.uri.startswith("sqlite:////") and cfg.data.cache_dir.startswith("/")


@pytest.mark.parametrize(
    "overrides,nproc,gpus,device,threads",
    [
        (["launcher.nodes=2", "launcher.gpus_per_node=8"], 8, 8, "cuda", 1),  # a rank per GPU
        (["launcher.nodes=2", "launcher.nproc_per_node=4"], 4, 4, "cuda", 1),  # auto: GPU nodes
        (["launcher.device=cpu", "launcher.nproc_per_node=2", "launcher.cpus_per_task=3"], 2, 0, "cpu", 3),
        (["launcher.device=cpu", "parallelism=tp", "parallelism.tensor_parallel_degree=4"], 4, 0, "cpu", 1),
    ],
)
def test_slurm_counts_come_from_the_config_not_this_machine(placement_env, overrides, nproc, gpus, device, threads):
    cfg = resolved(["launcher=slurm", *overrides])
    launcher = cfg.launcher
    assert (launcher.nproc_per_node, launcher.gpus_per_node, launcher.device) == (nproc, gpus, device)
    assert launcher.cpu_threads_per_rank == threads
    assert cfg.parallelism.degrees() and -1 not in cfg.parallelism.degrees().values()


def test_folders_are_tried_for_writing_and_nothing_is_left_behind(placement_env, tmp_path):
    folder = tmp_path / "new" / "checkpoints"
    cfg = resolved(["checkpoint=periodic", f"checkpoint.folder={folder}"])
    assert cfg.checkpoint.folder == str(folder)
    assert not (tmp_path / "new").exists()  # made for the try, removed again

"""What every rank process runs first, whoever started it (our launcher, torchrun, srun): take its
place in the job from the environment, start rank 0's MLflow writer, then import torch and train.

Torch-free at import: the launching process imports this module to hand `run_rank` to the
launcher, and rank 0 starts its writer before torch is loaded (see tracking/writer.py)."""

import contextlib

from launchers.env import RankEnv, export_slurm_environment
from titan_exp.config.schema import JobConfig
from titan_exp.job.context import RunContext
from titan_exp.job.tracked_run import tracked_run


def run_rank(args: tuple[JobConfig, RunContext]) -> dict[str, float]:
    """A rank's body; returns its last logged metrics (rank 0's are the job's)."""
    cfg, ctx = args
    if ctx.started_by == "srun":
        export_slurm_environment()  # torch.distributed reads RANK, MASTER_ADDR, ... from here on
    env = RankEnv.from_environ()
    tracking = env.rank == 0 and cfg.tracking.enable
    with tracked_run(cfg, ctx) if tracking else contextlib.nullcontext() as tracker:
        from titan_exp.train.trainer import train  # torch, after the writer has started

        return train(cfg, env, tracker)

"""titan_exp's pipelined step on real gloo ranks: the last stage returns no outputs, so it keeps
none of its microbatches' logits past their loss (torch's schedules keep every one until the step
ends unless told not to; estimate/memory.py prices that only with plan.pipeline_returns_outputs)."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from launchers.rendezvous import free_port
from titan_exp.config.resolve import resolve
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.train.model_parts import build_model_parts, materialize
from titan_exp.train.step import build_pipeline

from conftest import SMALL_MODEL, compose_config

MICROBATCHES = 4
SEQ_LEN = 32
SCHEDULES = ("1F1B", "Interleaved1F1B")  # torch's single-stage and multi-stage step paths


def _rank(rank: int, port: int, results: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for schedule in SCHEDULES:
            results[schedule, rank] = _step(schedule)
    finally:
        dist.destroy_process_group()


def _step(schedule: str) -> tuple[dict[int, int], float, bool]:
    """One step of a 2-rank pipeline: the outputs each of this rank's stages keeps, its loss, and
    whether it holds the last stage."""
    overrides = ["parallelism=pp", f"parallelism.pipeline_parallel_schedule={schedule}"]
    overrides += [*SMALL_MODEL, "model.n_layers=4"]  # two stages a rank under Interleaved1F1B
    overrides += ["launcher.nproc_per_node=2", "launcher.device=cpu", "tracking=none"]
    overrides += [f"training.local_batch_size={MICROBATCHES}", f"training.seq_len={SEQ_LEN}"]
    job = resolve(OmegaConf.to_object(compose_config(overrides)))
    device = torch.device("cpu")
    mesh = ParallelMesh(job.dims, "cpu")
    model = build_model_parts(job.config, mesh, device)
    materialize(model, job.config, device)
    pipeline = build_pipeline(job, model, mesh, device)
    tokens = torch.randint(0, job.config.model.vocab_size, (MICROBATCHES, SEQ_LEN + 1))
    loss = pipeline.step(tokens[:, :-1], tokens[:, 1:])
    stages = getattr(pipeline.schedule, "_stages", None) or [pipeline.schedule._stage]
    return {stage.stage_index: len(stage.output_chunks) for stage in stages}, float(loss), pipeline.has_last


def test_the_last_stage_keeps_no_microbatch_output_after_a_step():
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(free_port(), results), nprocs=2)
    for schedule in SCHEDULES:
        [(kept, loss)] = [(kept, loss) for kept, loss, last in (results[schedule, r] for r in range(2)) if last]
        assert kept and all(count == 0 for count in kept.values()), (schedule, kept)  # 4 each, were they returned
        assert 0 < loss < 20  # the step ran its microbatches to their loss

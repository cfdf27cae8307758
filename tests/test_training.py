"""Real multi-process training on CPU ranks (gloo), results read back from a real MLflow store."""

import pytest

from launchers.devices import cpu_cores

from conftest import loss_curve, mlflow_runs, run_cli

SHORT_RUN = [
    "data=synthetic",
    "training.steps=10",
    "training.local_batch_size=2",
    "training.seq_len=64",
    "metrics.log_freq=1",
    "lr_scheduler.warmup_steps=2",
    "launcher.device=cpu",
]


@pytest.mark.parametrize(
    "layout,nproc,mesh",
    # 4-rank DDP and FSDP add little: HSDP here and the parity matrix run 4 and 8 ranks.
    [
        ("ddp", 2, "dp_replicate2"),
        ("fsdp", 2, "dp_shard2"),
        # 4 ranks on the 2 CI cores; the parity suite runs hsdp by default.
        pytest.param("hsdp", 4, "dp_replicate2·dp_shard2", marks=pytest.mark.slow),
    ],
)
def test_layout_trains_and_lowers_the_loss(tmp_path, store, layout, nproc, mesh):
    uri, db = store
    ranks = [f"launcher.nproc_per_node={nproc}", f"launcher.oversubscribe={nproc > cpu_cores()}"]
    result = run_cli([*SHORT_RUN, f"parallelism={layout}", *ranks, uri], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run] = mlflow_runs(db)
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == str(nproc) and run.data.tags["mesh"] == mesh
    assert run.data.params["derived/mesh"] == mesh
    assert run.data.params["parallelism.name"] == layout
    losses = loss_curve(db, run.info.run_id)
    assert len(losses) == 10
    assert losses[-1] < losses[0] - 0.5, losses
    # Rank 0's output is streamed to the launching terminal.
    assert "step    10" in result.stdout
    # Where the start-up went: printed after the first step, and metrics that add up to the total.
    assert "start-up:" in result.stdout
    phases = {k: v for k, v in run.data.metrics.items() if k.startswith("startup/")}
    total = phases.pop("startup/total_s")
    named = ("python_imports", "compose", "spawn", "rank_imports", "torch_import", "model", "first_step")
    assert set(phases) >= {f"startup/{name}_s" for name in named}
    # Each phase is rounded to 1 ms; the rank process's creation is read from /proc in 10 ms ticks.
    assert sum(phases.values()) == pytest.approx(total, abs=0.02) and min(phases.values()) > -0.02

"""The CUDA path (nccl, one rank per GPU, allocator memory stats). Deselected by default; run with
`python -m pytest -m gpu` on a machine with GPUs."""

import pytest

from launchers.devices import visible_gpus

from conftest import loss_curve, mlflow_runs, run_cli

pytestmark = pytest.mark.gpu


def test_fsdp_on_every_gpu_reports_cuda_memory(tmp_path, store):
    gpus = visible_gpus()
    assert gpus > 0, "no GPU visible: this test needs a CUDA machine"
    uri, db = store
    args = [
        "experiment=smoke",
        "tracking=mlflow",
        uri,
        "launcher.device=cuda",
        f"launcher.nproc_per_node={gpus}",
        "training.steps=10",
        "training.mixed_precision_param=bfloat16",
    ]
    result = run_cli(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = mlflow_runs(db)
    assert run.data.tags["device"] == "cuda" and run.data.tags["world_size"] == str(gpus)
    assert run.data.metrics["memory/max_active_gib"] > 0 and "memory/cpu_rss_peak_gib" not in run.data.metrics
    losses = loss_curve(db, run.info.run_id)
    assert losses[-1] < losses[0]

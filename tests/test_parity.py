"""Numerical parity between layouts and training options, on real runs.

Tolerance: everything is fp32 with deterministic kernels and identical global batches and initial
weights, so layouts differ only in the order in which gradient sums are reduced (a local sum vs an
all-reduce / reduce-scatter over 2 ranks). Each such sum has a relative error of a few fp32 epsilons
(~1e-7); over a handful of AdamW steps the losses agree to ~1e-6 relative. We allow 1e-4: a hundred
times that, yet a hundred times smaller than the loss change per step (~1e-2), so a wrong gradient
scale, a wrong batch split or different initial weights would fail (the negative control checks
that a different seed is far outside it).
"""

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_config, loss_curve, mlflow_runs, run_cli
from titan_exp.config.schema import RunContext
from titan_exp.job import prepare
from titan_exp.train.trainer import train

RTOL = 1e-4
GLOBAL_BATCH = 4
PARITY_RUN = ["debug=deterministic", "data=synthetic", "training.steps=6", "training.seq_len=64", "metrics.log_freq=1", "launcher.device=cpu"]


def curve_of(tmp_path, store, name: str, overrides: list[str]) -> list[float]:
    uri, db = store
    result = run_cli([*PARITY_RUN, *overrides, uri], tmp_path / name)
    assert result.returncode == 0, result.stderr[-3000:]
    return loss_curve(db, mlflow_runs(db)[-1].info.run_id)


def test_single_ddp_and_fsdp_give_the_same_losses(tmp_path, store):
    single = curve_of(tmp_path, store, "single", ["parallelism=single", f"training.local_batch_size={GLOBAL_BATCH}"])
    ddp = curve_of(tmp_path, store, "ddp", ["parallelism=ddp", "launcher.nproc_per_node=2", f"training.local_batch_size={GLOBAL_BATCH // 2}"])
    fsdp = curve_of(tmp_path, store, "fsdp", ["parallelism=fsdp", "launcher.nproc_per_node=2", f"training.local_batch_size={GLOBAL_BATCH // 2}"])
    other_seed = curve_of(tmp_path, store, "other_seed", ["parallelism=single", f"training.local_batch_size={GLOBAL_BATCH}", "debug.seed=1"])
    assert len(single) == 6
    assert single[-1] < single[0]
    torch.testing.assert_close(ddp, single, rtol=RTOL, atol=0)
    torch.testing.assert_close(fsdp, single, rtol=RTOL, atol=0)
    assert max(abs(a - b) / b for a, b in zip(other_seed, single)) > 100 * RTOL


@pytest.fixture
def in_process(tmp_path):
    """Run the trainer in this process as a world of one (no tracking), restoring global torch state."""

    def run(overrides: list[str]) -> float:
        cfg, placement = prepare(OmegaConf.to_object(compose_config(["parallelism=single", "tracking=none", *PARITY_RUN, "training.steps=3", *overrides])))
        assert placement.world_size == 1
        return train(cfg, RunContext(job_dir=str(tmp_path), launcher="local"))["loss/global_avg"]

    yield run
    torch.use_deterministic_algorithms(False)


def test_gradient_accumulation_matches_one_big_batch(in_process):
    big = in_process(["training.local_batch_size=8"])
    accumulated = in_process(["training.local_batch_size=2", "training.global_batch_size=8"])
    assert accumulated == pytest.approx(big, rel=RTOL)


@pytest.mark.parametrize(
    "ac", [["activation_checkpoint.mode=full"], ["activation_checkpoint.mode=selective"], ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=2"]]
)
def test_activation_checkpointing_does_not_change_the_numbers(in_process, ac):
    assert in_process(ac) == pytest.approx(in_process([]), rel=RTOL)


@pytest.mark.slow
def test_compiled_blocks_match_eager(in_process):
    # Inductor fuses and reorders fp32 arithmetic, so a looser bound than between layouts.
    assert in_process(["compile.enable=true"]) == pytest.approx(in_process([]), rel=1e-3)

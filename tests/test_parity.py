"""Numerical parity between layouts and training options, on real runs: every layout starts from
one seed checkpoint and must reproduce the single-device loss curve over 10 steps.

Tolerance: everything is fp32 with deterministic kernels and identical global batches and initial
weights, so layouts differ only in the order in which gradient sums are reduced (a local sum vs an
all-reduce / reduce-scatter over 2 ranks). Each such sum has a relative error of a few fp32 epsilons
(~1e-7); over a handful of AdamW steps the losses agree to ~1e-6 relative. We allow 1e-4: a hundred
times that, yet a hundred times smaller than the loss change per step (~1e-2), so a wrong gradient
scale, a wrong batch split or different initial weights would fail (the negative control checks
that other initial weights are far outside it).
"""

import pytest
import torch
from omegaconf import OmegaConf

from launchers.env import RankEnv
from titan_exp.config.resolve import resolve
from titan_exp.parallel.config import SCHEDULES
from titan_exp.train.trainer import Trainer

from conftest import compose_config, loss_curve, mlflow_runs, run_cli

RTOL = 1e-4
SEED_CHECKPOINT_SEED = 7
GLOBAL_BATCH = 4
STEPS = 10
PARITY_RUN = [
    "debug=deterministic",
    "data=synthetic",
    f"training.steps={STEPS}",
    "training.seq_len=64",
    "metrics.log_freq=1",
    "launcher.device=cpu",
    "launcher.oversubscribe=true",  # 4 and 8 ranks on a 2-core machine: the numbers, not the speed
]


def curve_of(tmp_path, store, name: str, overrides: list[str]) -> list[float]:
    uri, db = store
    result = run_cli([*PARITY_RUN, *overrides, uri], tmp_path / name)
    assert result.returncode == 0, result.stderr[-3000:]
    return loss_curve(db, mlflow_runs(db)[-1].info.run_id)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Runs a layout from the module's seed checkpoint; `matrix.single` is the reference curve. The
    checkpoint holds the weights of SEED_CHECKPOINT_SEED, the runs use the default seed (for their
    data and, without the checkpoint, their weights): every layout loads it, and
    test_tolerance_is_discriminating checks that the weights loaded are the checkpoint's."""
    root = tmp_path_factory.mktemp("matrix")
    store = (f"tracking.uri=sqlite:///{root / 'mlflow.db'}", root / "mlflow.db")
    seed = root / "seed"
    created = run_cli(
        [
            *PARITY_RUN,
            "parallelism=single",
            f"debug.seed={SEED_CHECKPOINT_SEED}",
            "checkpoint.create_seed_checkpoint=true",
            f"checkpoint.folder={seed}",
            "tracking=none",
        ],
        root / "create",
    )
    assert created.returncode == 0, created.stderr[-3000:]
    assert (seed / "step-0" / ".metadata").is_file()

    class Matrix:
        load = f"checkpoint.initial_load_path={seed}/step-0"

        def curve(self, name: str, overrides: list[str], from_seed: bool = True) -> list[float]:
            return curve_of(root, store, name, [*overrides, self.load] if from_seed else overrides)

        def sweep(self, overrides: list[str]) -> list:
            result = run_cli([*PARITY_RUN, *overrides, self.load, store[0]], root / "sweep", flags=("-m",), timeout=900)
            assert result.returncode == 0, result.stderr[-3000:]
            return [(run, loss_curve(store[1], run.info.run_id)) for run in mlflow_runs(store[1])]

    matrix = Matrix()
    matrix.single = matrix.curve("single", ["parallelism=single", f"training.local_batch_size={GLOBAL_BATCH}"])
    assert len(matrix.single) == STEPS and matrix.single[-1] < matrix.single[0]
    return matrix


# Context parallel on CPU ranks runs the all-gather attention: a chunk given the wrong rope
# positions, mask offset or loss weight leaves the band.
TP2_CP2 = ("parallelism.data_parallel_shard_degree=1", "parallelism.tensor_parallel_degree=2")
CP2_PP2 = ("parallelism.pipeline_parallel_degree=2", "parallelism.context_parallel_degree=2")


@pytest.mark.parametrize(
    "layout,nproc,local_batch,extra",
    [
        ("ddp", 2, 2, ()),
        ("fsdp", 2, 2, ()),
        ("hsdp", 4, 1, ()),
        ("tp", 2, 4, ()),
        ("fsdp_tp", 4, 2, ()),
        ("fsdp_pp", 4, 2, ()),
        # 8 ranks on the 2 CI cores; fsdp_tp and fsdp_pp run by default.
        pytest.param("fsdp_tp_pp", 8, 2, (), marks=pytest.mark.slow),
        ("cp", 2, 4, ()),
        pytest.param("fsdp_cp", 4, 2, (), marks=pytest.mark.slow),  # cp and tp×cp run by default
        ("fsdp_cp", 4, 4, TP2_CP2),
        pytest.param("cp", 4, 4, CP2_PP2, marks=pytest.mark.slow),
    ],
    ids=["ddp", "fsdp", "hsdp", "tp", "fsdp_tp", "fsdp_pp", "fsdp_tp_pp", "cp", "fsdp_cp", "tp2_cp2", "pp2_cp2"],
)
def test_layout_reproduces_the_single_device_curve(matrix, layout, nproc, local_batch, extra, request):
    curve = matrix.curve(
        request.node.callspec.id,
        [
            f"parallelism={layout}",
            f"launcher.nproc_per_node={nproc}",
            f"training.local_batch_size={local_batch}",
            *extra,
        ],
    )
    torch.testing.assert_close(curve, matrix.single, rtol=RTOL, atol=0)


@pytest.mark.parametrize(
    "schedules",
    [("1F1B", "ZBVZeroBubble"), pytest.param(SCHEDULES, marks=pytest.mark.slow)],
    ids=["single_and_multi_stage", "every"],
)
def test_pipeline_schedules_reproduce_the_single_device_curve(matrix, schedules):
    # One sweep over the schedules: 2 pp ranks, 4 microbatches of 1 sample (DualPipeV needs one per stage).
    runs = matrix.sweep(
        [
            "parallelism=pp",
            "launcher.nproc_per_node=2",
            f"training.local_batch_size={GLOBAL_BATCH}",
            f"parallelism.pipeline_parallel_schedule={','.join(schedules)}",
        ]
    )
    pipelined = [(run, curve) for run, curve in runs if run.data.params["parallelism.name"] == "pp"]
    pipelined = pipelined[-len(schedules) :]  # this sweep's runs (the matrix's store holds earlier ones)
    schedules_run = [run.data.params["parallelism.pipeline_parallel_schedule"] for run, _ in pipelined]
    assert sorted(schedules_run) == sorted(schedules)
    for schedule, (_, curve) in zip(schedules_run, pipelined):
        torch.testing.assert_close(curve, matrix.single, rtol=RTOL, atol=0, msg=lambda m, s=schedule: f"{s}: {m}")


def test_tolerance_is_discriminating(matrix):
    # Without the seed checkpoint (the default seed's weights, the same data) the curve leaves the band: the
    # band tells weights apart, and the layouts' runs trained from the checkpoint's weights.
    fresh = matrix.curve("fresh", ["parallelism=single", f"training.local_batch_size={GLOBAL_BATCH}"], from_seed=False)
    assert max(abs(a - b) / b for a, b in zip(fresh, matrix.single)) > 100 * RTOL


@pytest.fixture
def in_process():
    """Run the trainer in this process as a world of one (no tracking), restoring global torch state."""

    def run(overrides: list[str]) -> float:
        job = resolve(
            OmegaConf.to_object(
                compose_config(["parallelism=single", "tracking=none", *PARITY_RUN, "training.steps=3", *overrides])
            )
        )
        assert job.dims.world_size == 1
        return Trainer.run(job, RankEnv(rank=0, local_rank=0, world_size=1, local_world_size=1))["loss/global_avg"]

    yield run
    torch.use_deterministic_algorithms(False)


def test_gradient_accumulation_matches_one_big_batch(in_process):
    big = in_process(["training.local_batch_size=8"])
    accumulated = in_process(["training.local_batch_size=2", "training.global_batch_size=8"])
    assert accumulated == pytest.approx(big, rel=RTOL)


@pytest.mark.parametrize(
    "ac",
    [
        ["activation_checkpoint.mode=full"],
        ["activation_checkpoint.mode=selective"],
        ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=2"],
    ],
)
def test_activation_checkpointing_does_not_change_the_numbers(in_process, ac):
    assert in_process(ac) == pytest.approx(in_process([]), rel=RTOL)


@pytest.mark.slow
def test_compiled_blocks_match_eager(in_process):
    # Inductor fuses and reorders fp32 arithmetic, so a looser bound than between layouts.
    assert in_process(["compile.enable=true"]) == pytest.approx(in_process([]), rel=1e-3)


@pytest.mark.parametrize(
    "layout",
    [
        "parallelism=fsdp",
        pytest.param("parallelism=pp parallelism.pipeline_parallel_schedule=Interleaved1F1B", marks=pytest.mark.slow),
    ],
)
def test_resume_continues_the_same_curve(tmp_path, store, layout):
    uri, db = store
    folder = tmp_path / "ckpt"
    args = [
        *PARITY_RUN,
        *layout.split(),
        "launcher.nproc_per_node=2",
        "checkpoint=periodic",
        f"checkpoint.folder={folder}",
        "checkpoint.interval=5",
        "checkpoint.keep_latest_k=0",
        uri,
    ]
    whole = run_cli(args, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == ["step-10", "step-5"]
    whole_curve = loss_curve(db, mlflow_runs(db)[-1].info.run_id)
    import shutil

    shutil.rmtree(folder / "step-10")
    resumed = run_cli(args, tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    resumed_curve = loss_curve(db, mlflow_runs(db)[-1].info.run_id)
    assert len(resumed_curve) == 5  # steps 6..10
    torch.testing.assert_close(resumed_curve, whole_curve[5:], rtol=RTOL, atol=0)


# float8 matmuls run through torch._scaled_mm's reference kernel on CPU (~20 M multiply-adds/s), so
# the float8 comparison uses a model small enough for that. Its Linear dims are multiples of 16.
TINY_MODEL = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.multiple_of=16",
    "training.seq_len=32",
    "training.steps=3",
]
# float8 (e4m3) keeps 3 mantissa bits, but rounding errors average out over dot products of >= 64
# terms and over the tokens of the loss; torchtitan's float8 curves stay within ~1% of bf16. We allow 1%.
FLOAT8_RTOL = 1e-2


FSDP = ["parallelism=fsdp", "launcher.nproc_per_node=2"]
# Same global batch throughout: fsdp_tp on 4 ranks has 2 data-parallel ranks, like fsdp on 2.
FLOAT8_VARIANTS = {
    "tensorwise": [*FSDP, "quantize=float8"],
    "rowwise": [*FSDP, "quantize=float8_rowwise"],
    "fsdp_float8_all_gather": [*FSDP, "quantize=float8", "quantize.enable_fsdp_float8_all_gather=true"],
    "tensorwise_fsdp_tp": ["parallelism=fsdp_tp", "launcher.nproc_per_node=4", "quantize=float8"],
}


@pytest.mark.parametrize(
    "names",
    [("tensorwise",), pytest.param(tuple(FLOAT8_VARIANTS), marks=pytest.mark.slow)],
    ids=["tensorwise", "every"],
)
def test_float8_stays_close_to_full_precision(tmp_path, store, names):
    uri, db = store
    reference = curve_of(tmp_path, store, "fp32", [*FSDP, *TINY_MODEL])
    variants = {name: FLOAT8_VARIANTS[name] for name in names}
    for name, overrides in variants.items():
        low = curve_of(tmp_path, store, name, [*overrides, *TINY_MODEL])
        torch.testing.assert_close(low, reference, rtol=FLOAT8_RTOL, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    float8_runs = [r for r in mlflow_runs(db) if r.data.params["quantize.name"] == "float8"]
    assert len(float8_runs) == len(variants)
    assert not any("throughput/mfu_pct" in r.data.metrics for r in float8_runs)  # not defined in low precision


def test_loss_parity_preset_writes_table_and_plot(tmp_path, store):
    uri, db = store
    layouts = (
        "parity.layouts=['parallelism=single','parallelism=fsdp launcher.nproc_per_node=2 training.local_batch_size=2']"
    )
    result = run_cli(["experiment=loss_parity", layouts, "training.steps=4", uri], tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    table = (tmp_path / "run" / "loss_parity.md").read_text()
    assert table.count("| yes |") == 2 and "| NO |" not in table
    png = (tmp_path / "run" / "loss_parity.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    # The layouts' runs are children of one parent run, which holds the report and the comparison.
    [parent] = mlflow_runs(db, sweeps=True)
    assert parent.info.run_name == "loss_parity" and parent.info.status == "FINISHED"
    assert {run.data.tags["mlflow.parentRunId"] for run in mlflow_runs(db)} == {parent.info.run_id}
    artifacts = db.parent / "mlartifacts" / "titan_exp" / parent.info.run_id / "artifacts"
    assert (artifacts / "parity" / "loss_parity.md").read_text() == table
    assert (artifacts / "compare" / "strategy_table.csv").read_text().count("FINISHED") == 2

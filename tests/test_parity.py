"""Numerical parity between layouts and training options, on real runs: one experiment=loss_parity
run trains every layout from one seed checkpoint, and each must reproduce the single-device loss
curve over 10 steps, and its held-out loss; and training options in this process (gradient
accumulation, activation checkpointing, float8). A run resumed from a checkpoint continues the
same curve: test_data_files.py.

Tolerance: everything is fp32 with deterministic kernels and identical global batches and initial
weights, so layouts differ only in the order in which gradient sums are reduced (a local sum vs an
all-reduce / reduce-scatter over 2 ranks). Each such sum has a relative error of a few fp32 epsilons
(~1e-7); over a handful of AdamW steps the losses agree to ~1e-6 relative. We allow 1e-4: a hundred
times that, yet a hundred times smaller than the loss change per step (~1e-2), so a wrong gradient
scale, a wrong batch split or different initial weights would fail (the negative control checks
that other initial weights are far outside it).
"""

import re
from dataclasses import dataclass

import pytest
import torch
from omegaconf import OmegaConf

from launchers.env import RankEnv
from titan_exp.config.resolve import resolve
from titan_exp.job.parity import layout_folder
from titan_exp.metric_names import LOSS, MFU, STEP_SECONDS, VALIDATION_LOSS
from titan_exp.parallel.config import SCHEDULES
from titan_exp.tracking.journal import RUN_ID_FILE
from titan_exp.train.trainer import Trainer

from conftest import (
    SMALL_MODEL,
    assert_startup_adds_up,
    compose_config,
    loss_curve,
    mlflow_client,
    mlflow_runs,
    run_cli,
)

RTOL = 1e-4
SEED_CHECKPOINT_SEED = 7
GLOBAL_BATCH = 4
STEPS = 10
# One ordinary job with experiment=loss_parity's settings (deterministic fp32, synthetic data, a
# global batch of GLOBAL_BATCH): what each of its layouts runs.
PARITY_RUN = [
    "experiment=loss_parity",
    "parity.layouts=[]",
    f"training.steps={STEPS}",
    "launcher.oversubscribe=true",  # 4 and 8 ranks on a 2-core machine: the numbers, not the speed
]


def curve_of(tmp_path, store, name: str, overrides: list[str]) -> list[float]:
    uri, db = store
    result = run_cli([*PARITY_RUN, *overrides, uri], tmp_path / name)
    assert result.returncode == 0, result.stderr[-3000:]
    return loss_curve(db, mlflow_runs(db)[-1].info.run_id)


# Context parallel on CPU ranks runs the all-gather attention: a chunk given the wrong rope
# positions, mask offset or loss weight leaves the band.
TP2_CP2 = "parallelism.data_parallel_shard_degree=1 parallelism.tensor_parallel_degree=2"
CP2_PP2 = "parallelism.pipeline_parallel_degree=2 parallelism.context_parallel_degree=2"
ACCUMULATING, LAST = f"training.global_batch_size={GLOBAL_BATCH}", "training.gradient_sync=last_microbatch"
# Each layout (the first is the reference), a global batch of GLOBAL_BATCH: its parallelism, its
# ranks and their local batch, and the mesh its run is tagged with.
LAYOUTS = {
    "single": ("parallelism=single", 1, GLOBAL_BATCH, "single"),
    "ddp": ("parallelism=ddp", 2, 2, "dp_replicate2"),
    "fsdp": ("parallelism=fsdp", 2, 2, "dp_shard2"),
    "hsdp": ("parallelism=hsdp", 4, 1, "dp_replicate2·dp_shard2"),
    "tp": ("parallelism=tp", 2, 4, "tp2"),
    "fsdp_tp": ("parallelism=fsdp_tp", 4, 2, "dp_shard2·tp2"),
    "fsdp_pp": ("parallelism=fsdp_pp", 4, 2, "pp2·dp_shard2"),
    "cp": ("parallelism=cp", 2, 4, "cp2"),
    "tp2_cp2": (f"parallelism=fsdp_cp {TP2_CP2}", 4, 4, "cp2·tp2"),
    # 2 pp ranks, 4 microbatches of 1 sample; every other schedule (looped, V-shaped, zero-bubble)
    # in test_every_pipeline_schedule_reproduces_the_single_device_curve (slow).
    "pp_1F1B": ("parallelism=pp parallelism.pipeline_parallel_schedule=1F1B", 2, GLOBAL_BATCH, "pp2"),
    "fsdp_tp_pp": ("parallelism=fsdp_tp_pp", 8, 2, "pp2·dp_shard2·tp2"),
    "fsdp_cp": ("parallelism=fsdp_cp", 4, 2, "dp_shard2·cp2"),
    "pp2_cp2": (f"parallelism=cp {CP2_PP2}", 4, 4, "pp2·cp2"),
    # 2 microbatches of 1 sample: each reduced (the default), or the sum reduced after the last.
    "fsdp_accumulating": (f"parallelism=fsdp {ACCUMULATING}", 2, 1, "dp_shard2"),
    "fsdp_accumulating_last": (f"parallelism=fsdp {ACCUMULATING} {LAST}", 2, 1, "dp_shard2"),
    "ddp_accumulating": (f"parallelism=ddp {ACCUMULATING}", 2, 1, "dp_replicate2"),
}
# Beyond the default run (each from its seed checkpoint, a job of its own). The default run holds
# a layout of each dimension the other files do not train to the same loss by default: TP (with
# SP), CP and a pipeline schedule. DDP's and HSDP's gradients are held against one
# device's per parameter in test_expert_parallel.py (ddp2·tp2·ep2, hsdp2x2·ep2), FSDP's trained
# weights against one device's in test_hf_weights.py; the layouts below put dimensions together
# (and 8 ranks).
SLOW = (
    "ddp",
    "fsdp",
    "hsdp",
    "fsdp_tp",
    "fsdp_pp",
    "tp2_cp2",
    "fsdp_tp_pp",
    "fsdp_cp",
    "pp2_cp2",
    "fsdp_accumulating_last",
    "ddp_accumulating",
)
DEFAULT = [name for name in LAYOUTS if name not in SLOW]


def _layout(parallelism: str, nproc: int, local_batch: int) -> str:
    return f"{parallelism} launcher.nproc_per_node={nproc} training.local_batch_size={local_batch}"


def _default_run(request) -> list[str]:
    """The layouts of the default run: DEFAULT where a test of the default suite here is selected;
    the reference alone in a session of slow tests only (they need its curve and the checkpoint)."""
    selected = [item for item in request.session.items if item.module is request.module]
    return DEFAULT if any(item.get_closest_marker("slow") is None for item in selected) else ["single"]


@pytest.fixture(scope="module")
def parity(tmp_path_factory, request):
    """One `experiment=loss_parity` run over LAYOUTS, as a user runs it: a seed checkpoint, then every
    layout from it, compared in a table and a plot under one parent run. The checkpoint holds the
    weights of SEED_CHECKPOINT_SEED (the command's seed); every layout trains with seed 0 (its data
    and, had it not loaded the checkpoint, its weights): test_tolerance_is_discriminating checks that
    the weights loaded are the checkpoint's. Yields the run's folder, store, output and curves."""
    root = tmp_path_factory.mktemp("parity")
    db = root / "mlflow.db"
    uri_and_db = (f"tracking.uri=sqlite:///{db}", db)
    default_run = _default_run(request)
    layouts = [f"{_layout(*LAYOUTS[name][:3])} debug.seed=0" for name in default_run]
    result = run_cli(
        [
            *PARITY_RUN,
            f"debug.seed={SEED_CHECKPOINT_SEED}",
            "parity.layouts=[" + ",".join(f"'{layout}'" for layout in layouts) + "]",
            uri_and_db[0],
        ],
        root,
        timeout=900,
    )
    point_runs = {
        name: mlflow_client(db).get_run((root / "run" / layout_folder(layout) / RUN_ID_FILE).read_text().strip())
        for name, layout in zip(default_run, layouts)
    }

    class Parity:
        run_dir, store, output, runs = root / "run", db, result, point_runs
        curves = {name: loss_curve(db, run.info.run_id) for name, run in point_runs.items()}
        load = f"checkpoint.initial_load_path={root / 'run' / 'seed_checkpoint'}/step-0"

        def run(self, name: str) -> object:
            """The layout's run: the default run's, or (beyond it) a job of its own from the seed checkpoint."""
            if name not in self.runs:
                curve_of(root, uri_and_db, name, [*_layout(*LAYOUTS[name][:3]).split(), self.load])
                self.runs[name] = mlflow_runs(db)[-1]
                self.curves[name] = loss_curve(db, self.runs[name].info.run_id)
            return self.runs[name]

        def curve(self, name: str, overrides: list[str]) -> list[float]:
            return curve_of(root, uri_and_db, name, [*overrides, self.load])

    reference = Parity.curves["single"]
    assert len(reference) == STEPS and reference[-1] < reference[0] - 0.5, reference
    return Parity()


def test_loss_parity_writes_its_table_and_plot_under_one_parent_run(parity):
    assert parity.output.returncode == 0, parity.output.stdout[-2000:] + parity.output.stderr[-3000:]
    table = (parity.run_dir / "loss_parity.md").read_text()
    assert table.count("| yes |") == len(DEFAULT) and "| NO |" not in table and "final validation loss" in table
    png = (parity.run_dir / "loss_parity.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    [parent] = mlflow_runs(parity.store, sweeps=True)
    assert parent.info.run_name == "loss_parity" and parent.info.status == "FINISHED"
    assert {run.data.tags["mlflow.parentRunId"] for run in mlflow_runs(parity.store)} == {parent.info.run_id}
    artifacts = parity.store.parent / "mlartifacts" / "titan_exp" / parent.info.run_id / "artifacts"
    assert (artifacts / "parity" / "loss_parity.md").read_text() == table
    assert (artifacts / "compare" / "strategy_table.csv").read_text().count("FINISHED") == len(DEFAULT)


def held_out_curve(db, run) -> list[tuple[int, float]]:
    history = mlflow_client(db).get_metric_history(run.info.run_id, VALIDATION_LOSS)
    return [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_layout_reproduces_the_single_device_curve(parity, name):
    parallelism, nproc, _, mesh = LAYOUTS[name]
    run = parity.run(name)
    assert run.info.status == "FINISHED"
    assert (
        run.data.tags["world_size"] == str(nproc) and run.data.tags["mesh"] == run.data.params["derived/mesh"] == mesh
    )
    assert run.data.params["parallelism.name"] == parallelism.split()[0].removeprefix("parallelism=")
    assert len(parity.curves[name]) == STEPS
    torch.testing.assert_close(parity.curves[name], parity.curves["single"], rtol=RTOL, atol=0)
    # The held-out loss (experiment=loss_parity validates every 5 steps, pipelines through their
    # schedule's forward-only pass) agrees as closely; the model learns the chain: it falls.
    held_out, reference = (held_out_curve(parity.store, parity.run(n)) for n in (name, "single"))
    assert [step for step, _ in reference] == [5, 10] and reference[1][1] < reference[0][1], reference
    assert [step for step, _ in held_out] == [5, 10], held_out
    torch.testing.assert_close([loss for _, loss in held_out], [loss for _, loss in reference], rtol=RTOL, atol=0)
    # Where the point's start-up went (from its own process's start): in its log, and as metrics;
    # the held-out loss is said there too.
    logs = parity.store.parent / "mlartifacts" / "titan_exp" / run.info.run_id / "artifacts" / "logs"
    log = (logs / "rank0.log").read_text()
    assert "start-up:" in log and "step    10  validation loss" in log, log[-2000:]
    assert_startup_adds_up(run, ("spawn", "rank_imports", "torch_import", "model", "first_step"))


@pytest.mark.slow
def test_every_pipeline_schedule_reproduces_the_single_device_curve(parity):
    for schedule in SCHEDULES:
        layout = _layout(f"parallelism=pp parallelism.pipeline_parallel_schedule={schedule}", 2, GLOBAL_BATCH)
        curve = parity.curve(schedule, layout.split())
        reference = parity.curves["single"]
        torch.testing.assert_close(curve, reference, rtol=RTOL, atol=0, msg=lambda m, s=schedule: f"{s}: {m}")


def test_tolerance_is_discriminating(parity, in_process):
    # Without the seed checkpoint (seed 0's weights, the same data) the curve leaves the band: the
    # band tells weights apart, and the layouts' runs trained from the checkpoint's weights.
    fresh = in_process([f"training.steps={STEPS}", f"training.local_batch_size={GLOBAL_BATCH}", "debug.seed=0"])
    assert len(fresh.curve) == STEPS
    assert max(abs(a - b) / b for a, b in zip(fresh.curve, parity.curves["single"])) > 100 * RTOL


@dataclass
class InProcess:
    metrics: dict  # rank 0's last logged metrics
    curve: list[float]  # the loss of each step as printed (4 decimals)


@pytest.fixture(scope="module")
def runs_in_process() -> dict[tuple[str, ...], InProcess]:
    """The in-process runs made so far, by their overrides: deterministic, each is made once."""
    return {}


@pytest.fixture
def in_process(capsys, runs_in_process):
    """Run the trainer in this process as a world of one (no tracking), restoring global torch state."""

    def run(overrides: list[str]) -> InProcess:
        if tuple(overrides) in runs_in_process:
            return runs_in_process[tuple(overrides)]
        job = resolve(
            OmegaConf.to_object(
                compose_config(["parallelism=single", "tracking=none", *PARITY_RUN, "training.steps=3", *overrides])
            )
        )
        assert job.dims.world_size == 1
        capsys.readouterr()
        metrics = Trainer.run(job, RankEnv(rank=0, local_rank=0, world_size=1, local_world_size=1))
        printed = capsys.readouterr().out
        curve = [float(loss) for loss in re.findall(r"^step +\d+/\d+  loss +(\S+)", printed, re.M)]
        runs_in_process[tuple(overrides)] = InProcess(metrics, curve)
        return runs_in_process[tuple(overrides)]

    yield run
    torch.use_deterministic_algorithms(False)


def test_gradient_accumulation_matches_one_big_batch(in_process):
    big = in_process(["training.local_batch_size=8"]).metrics[LOSS]
    accumulated = in_process(["training.local_batch_size=2", "training.global_batch_size=8"]).metrics[LOSS]
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
    assert in_process(ac).metrics[LOSS] == pytest.approx(in_process([]).metrics[LOSS], rel=RTOL)


@pytest.mark.slow
def test_compiled_blocks_match_eager(in_process):
    # Inductor fuses and reorders fp32 arithmetic, so a looser bound than between layouts.
    assert in_process(["compile.enable=true"]).metrics[LOSS] == pytest.approx(in_process([]).metrics[LOSS], rel=1e-3)


@pytest.mark.slow
def test_a_compiled_loss_on_vocabulary_shards_matches_eager(tmp_path, store):
    """TP 2 with the loss compiled inside loss_parallel, twice over one Inductor cache (the second
    run finds the first's graphs there: in torch 2.13 AOTAutograd's cached graph of this loss
    returned a wrong one, which train/loss.py keeps out), against the eager loss."""
    tp = ["parallelism=tp", "launcher.nproc_per_node=2", "training.steps=3"]
    compiled = [*tp, "compile.enable=true", "compile.components=[loss]"]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    eager = curve_of(tmp_path, store, "eager", tp)
    for name in ("first", "cached"):
        uri, db = store
        result = run_cli([*PARITY_RUN, *compiled, uri], tmp_path / name, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        curve = loss_curve(db, mlflow_runs(db)[-1].info.run_id)
        # Inductor fuses the float32 log-sum-exp in another order: a looser bound than between layouts.
        torch.testing.assert_close(curve, eager, rtol=1e-3, atol=0)


# float8 matmuls run through torch._scaled_mm's reference kernel on CPU (~20 M multiply-adds/s), so
# the float8 comparison uses a model small enough for that. Its Linear dims are multiples of 16.
TINY_MODEL = [
    *SMALL_MODEL,
    "training.seq_len=32",
    "training.steps=3",
]
# float8 (e4m3) keeps 3 mantissa bits, but rounding errors average out over dot products of >= 64
# terms and over the tokens of the loss; torchtitan's float8 curves stay within ~1% of bf16. We allow 1%.
FLOAT8_RTOL = 1e-2
# CPU ranks emulate the float8 matmuls (torch's CPU kernel took minutes a step, thousands of times
# fp32's): a step within 200× the full-precision one, measured side by side, tells the two apart. On
# this tiny model the casts and scales dominate: 5-7× is usual, but one step of a busy machine took
# 73× (0.99 s beside 14 ms), so the bound stays far from the usual and far below the kernel's.
FLOAT8_STEP_TIMES = 200


def test_float8_stays_close_to_full_precision_in_this_process(in_process):
    """The rowwise recipe on one rank (every recipe, beside FSDP and TP on rank processes: below)."""
    reference = in_process(TINY_MODEL)
    low = in_process([*TINY_MODEL, "quantize=float8"])
    assert len(low.curve) == 3
    torch.testing.assert_close(low.curve, reference.curve, rtol=FLOAT8_RTOL, atol=0)
    assert MFU in reference.metrics and MFU not in low.metrics  # not defined in low precision
    assert low.metrics[STEP_SECONDS] < FLOAT8_STEP_TIMES * reference.metrics[STEP_SECONDS]


FSDP = ["parallelism=fsdp", "launcher.nproc_per_node=2"]
# Same global batch throughout: fsdp_tp on 4 ranks has 2 data-parallel ranks, like fsdp on 2.
FLOAT8_VARIANTS = {
    "tensorwise": [*FSDP, "quantize=float8_tensorwise"],
    "rowwise": [*FSDP, "quantize=float8"],
    "fsdp_float8_all_gather": [*FSDP, "quantize=float8_tensorwise", "quantize.enable_fsdp_float8_all_gather=true"],
    "tensorwise_fsdp_tp": ["parallelism=fsdp_tp", "launcher.nproc_per_node=4", "quantize=float8_tensorwise"],
}


@pytest.mark.slow
def test_every_float8_recipe_stays_close_to_full_precision_on_rank_processes(tmp_path, store):
    uri, db = store
    reference = curve_of(tmp_path, store, "fp32", [*FSDP, *TINY_MODEL])
    for name, overrides in FLOAT8_VARIANTS.items():
        low = curve_of(tmp_path, store, name, [*overrides, *TINY_MODEL])
        torch.testing.assert_close(low, reference, rtol=FLOAT8_RTOL, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    float8_runs = [r for r in mlflow_runs(db) if r.data.params["quantize.name"] == "float8"]
    assert len(float8_runs) == len(FLOAT8_VARIANTS)
    assert not any(MFU in r.data.metrics for r in float8_runs)
    [fp32_run] = [r for r in mlflow_runs(db) if r.data.params["quantize.name"] == "none"]
    for run in float8_runs:
        assert run.data.metrics[STEP_SECONDS] < FLOAT8_STEP_TIMES * fp32_run.data.metrics[STEP_SECONDS], run.data.tags

"""`python -m titan_exp plan`: predictions for one config and for a grid, recorded in MLflow and
set beside measured runs; published GPU layouts predicted plausibly; plan.prune in a sweep.
(Accuracy against real runs: benchmarks/bench_planner.py.)"""

import csv
import re
import time

import pytest

from titan_exp.config.compose import to_job_config
from titan_exp.job.memory import Budget, check_memory_fit
from titan_exp.plan import cli as plan_cli
from titan_exp.plan import point as plan_point
from titan_exp.plan.prune import prune
from titan_exp.rules import ConfigError
from titan_exp.units import GIB

from conftest import compose_config, mlflow_client, mlflow_runs, run_cli, subcommand

H100_96GB = ["hardware=h100", "hardware.memory_gib=96", "training.mixed_precision_param=bfloat16"]
SEQ_8K = ["training.seq_len=8192", "model.max_seq_len=8192"]


@pytest.fixture
def plan(capsys):
    """`titan_exp plan --out TMP/plan ARGS` in this process: its stdout and the rows of its plan.csv."""

    def run(args: list[str], tmp_path) -> tuple[str, list[dict]]:
        status = plan_cli.main(["--out", str(tmp_path / "plan"), *args])
        out, err = capsys.readouterr()
        assert status == 0, out[-2000:] + err[-3000:]
        return out, list(csv.DictReader(open(tmp_path / "plan" / "plan.csv")))

    return run


def test_a_grid_is_ranked_fitting_first_then_by_tps(tmp_path, plan):
    args = ["-m", "model=llama3_8b", *H100_96GB, *SEQ_8K, "launcher.nproc_per_node=8", "plan.measure=false"]
    args += ["parallelism=fsdp,fsdp_tp", "training.local_batch_size=1,2,8", "tracking=none"]
    _, rows = plan(args, tmp_path)
    assert len(rows) == 6 and [int(r["rank"]) for r in rows] == list(range(1, 7))
    fits = [r["fits"] == "yes" for r in rows]
    assert fits == sorted(fits, reverse=True) and True in fits and False in fits  # local batch 8 does not fit
    fitting = [float(r["TPS/device"].replace(",", "")) for r in rows if r["fits"] == "yes"]
    assert fitting == sorted(fitting, reverse=True)
    assert all(r["compute"] == "modelled" for r in rows)
    # Each TPS with its band (h100_grand_teton's published runs' 80th-percentile error); a fitting
    # layout whose band reaches the best one's is to be run beside it.
    for r in rows:
        low, high = (float(x.replace(",", "")) for x in r["TPS band"].split("–"))
        assert low < float(r["TPS/device"].replace(",", "")) < high
    best_low = float(rows[0]["TPS band"].split("–")[0].replace(",", ""))
    for r in rows[1:]:
        reaches = r["fits"] == "yes" and float(r["TPS band"].split("–")[1].replace(",", "")) >= best_low
        assert (r["run both"] == "with #1") == reaches, r
    html = (tmp_path / "plan" / "plan.html").read_text()
    assert html.count("<tr>") == 7 and (tmp_path / "plan" / "plan.md").read_text().count("\n") == 8


def test_a_grid_whose_points_share_a_tensor_parallel_mesh_is_planned(tmp_path, plan):
    """Each point's fake pass runs in this process, one fake world after another; the tp ranks of
    the second equal the first's, which DTensor's caches must not mistake for the same mesh. The
    MoE debug model with TP splitting its experts, beside EP: all-gathers and reduce-scatters."""
    args = ["model=qwen3_moe_debug", "hardware=h100", "launcher.nproc_per_node=8", "tracking=none"]
    args += ["parallelism.tensor_parallel_degree=4", "parallelism.expert_tensor_parallel_degree=4"]
    _, rows = plan([*args, "parallelism.expert_parallel_degree=1,2"], tmp_path)
    assert sorted(row["layout"] for row in rows) == ["fsdp2·tp4", "fsdp2·tp4·ep2·etp4"]
    assert all(float(row["peak GiB/rank"]) > 0 for row in rows)


def test_published_h100_layouts_are_predicted_plausibly(tmp_path, plan):
    """TorchTitan's published runs on 96 GB H100s at seq 8192 (its strategy-selection guide): Llama 3
    8B, FSDP 8, local batch 2, selective AC: 5,762 TPS/GPU in 82 GiB; 405B, FSDP 8 × TP 8 × PP 8 on 512 GPUs, full AC:
    fits under 1F1B and Interleaved1F1B."""
    args = ["model=llama3_8b", *H100_96GB, *SEQ_8K, "parallelism=fsdp", "launcher.nproc_per_node=8"]
    args += ["training.local_batch_size=2", "activation_checkpoint.mode=selective", "tracking=none"]
    _, [row] = plan(args, tmp_path / "8b")
    assert row["fits"] == "yes" and 40 < float(row["peak GiB/rank"]) < 86.4
    assert 3_000 < float(row["TPS/device"].replace(",", "")) < 12_000
    start = time.monotonic()
    args = ["-m", "model=llama3_405b", *H100_96GB, *SEQ_8K, "parallelism=fsdp_tp_pp", "launcher.nodes=64"]
    args += [
        "launcher.nproc_per_node=8",
        "parallelism.tensor_parallel_degree=8",
        "parallelism.pipeline_parallel_degree=8",
    ]
    args += ["training.local_batch_size=32", "activation_checkpoint.mode=full", "tracking=none"]
    args += ["parallelism.pipeline_parallel_schedule=1F1B,Interleaved1F1B"]
    _, rows = plan(args, tmp_path / "405b")
    assert time.monotonic() - start < 120  # measured memory included (the fake pass), 2 points
    assert {r["overrides"].split("schedule=")[1] for r in rows} == {"1F1B", "Interleaved1F1B"}
    for row in rows:
        assert row["fits"] == "yes" and 20 < float(row["peak GiB/rank"]) < 86.4, row
    # Interleaving keeps more microbatches in flight (the warm-up of v stages per rank), not fewer.
    by_schedule = {r["overrides"].split("schedule=")[1]: float(r["peak GiB/rank"]) for r in rows}
    assert by_schedule["Interleaved1F1B"] >= by_schedule["1F1B"]


# Every option of every group the planner must model, each planned once (modelled: no torch).
OPTIONS = {
    "compile": ["compile.enable=true"],
    "compile_model_only": ["compile.enable=true", "compile.components=[model]"],
    "float8_tensorwise": ["quantize=float8", "quantize.recipe=tensorwise",
                          "quantize.enable_fsdp_float8_all_gather=true"],
    "float8_rowwise": ["quantize=float8", "quantize.recipe=rowwise"],
    "mxfp8": ["quantize=mxfp8", "hardware=b200"],
    "cp_32k": ["parallelism=fsdp_cp", "parallelism.context_parallel_degree=4", "training.seq_len=32768",
               "model.max_seq_len=32768"],
    "cp_262k": ["parallelism=fsdp_cp", "parallelism.context_parallel_degree=8", "training.seq_len=262144",
                "model.max_seq_len=262144", "training.local_batch_size=1"],
    "async_tp": ["parallelism=fsdp_tp", "parallelism.tensor_parallel_degree=4", "compile.enable=true",
                 "parallelism.enable_async_tensor_parallel=true"],
    "hsdp": ["parallelism=hsdp", "parallelism.data_parallel_replicate_degree=2"],
    **{f"ac_{mode}": [f"activation_checkpoint.mode={mode}"] for mode in ("none", "full", "selective")},
    "ac_every_2": ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=2"],
    **{
        f"pp_{schedule}": ["parallelism=fsdp_pp", "parallelism.pipeline_parallel_degree=2",
                           f"parallelism.pipeline_parallel_schedule={schedule}", "training.local_batch_size=8"]
        for schedule in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                         "ZBVZeroBubble", "DualPipeV")
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_every_option_can_be_planned(name, tmp_path, plan):
    args = ["model=llama3_8b", *H100_96GB, "training.seq_len=8192", "model.max_seq_len=8192", "plan.measure=false"]
    args += ["launcher.nproc_per_node=8", "training.local_batch_size=2", "tracking=none", *OPTIONS[name]]
    out, [row] = plan(args, tmp_path)
    assert float(row["peak GiB/rank"]) > 0 and float(row["TPS/device"].replace(",", "")) > 0, out


def test_compile_is_planned_with_the_fake_pass_cross_check(tmp_path, plan):
    """The fake pass runs eager (Dynamo cannot trace under its memory tracker): no traceback."""
    out, [row] = plan(
        ["parallelism=fsdp", "launcher.nproc_per_node=2", "compile.enable=true", "tracking=none"], tmp_path
    )
    assert "cross-check" in out and row["fits"] == "yes"


def test_llama3_8b_fsdp8_accumulating_4_counts_what_each_gradient_sync_holds(tmp_path, plan):
    """Reducing after the last microbatch only, each rank holds every unit's unsharded float32
    gradient between microbatches (8.0e9 · 4 B = 30 GiB) instead of its eighth of them: the model
    and the dry run's fake pass (which steps through the 4 microbatches) both count it, and agree."""
    shape = ["model=llama3_8b", "parallelism=fsdp", "launcher.nproc_per_node=8", "training.local_batch_size=1"]
    shape += [*H100_96GB, *SEQ_8K, "training.global_batch_size=32", "activation_checkpoint.mode=full", "tracking=none"]
    active, fake = {}, {}
    for sync in ("every_microbatch", "last_microbatch"):
        out, [row] = plan([*shape, f"training.gradient_sync={sync}"], tmp_path / sync)
        assert row["accumulation"] == "4"
        active[sync] = float(re.search(r"\(([\d.]+) GiB active\)", out).group(1))
        fake[sync] = float(re.search(r"fake pass \(eager, tensors only\) finds ([\d.]+) GiB", out).group(1))
        assert fake[sync] == pytest.approx(active[sync], rel=0.1), out
    gradients = 8.03e9 * 4 / GIB * 7 / 8
    assert active["last_microbatch"] - active["every_microbatch"] == pytest.approx(gradients, rel=0.05)
    assert fake["last_microbatch"] - fake["every_microbatch"] == pytest.approx(gradients, rel=0.1)


def test_experts_split_by_tensor_parallelism_are_measured_on_a_one_rank_mesh(tmp_path, plan):
    """The planner times a layout's layers as training builds them: experts split by TP (tp2
    without EP) on its one-rank TP mesh (plan/measure.py) place their hidden-dim shards there."""
    overrides = ["model=deepseek_v3_debug", "parallelism=tp", "launcher.nproc_per_node=2", "tracking=none"]
    out, [row] = plan(overrides, tmp_path)
    assert row["compute"] == "measured" and float(row["step s"]) > 0, out


def test_an_option_the_hardware_cannot_run_is_refused_in_one_line(capsys):
    assert plan_cli.main(["quantize=mxfp8", "hardware=h100", "launcher.nproc_per_node=8", "tracking=none"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("titan_exp plan: config error: quantize=mxfp8:") and "b200" in line


def test_a_layout_that_does_not_fit_comes_with_fixes_that_fit(tmp_path, plan):
    args = ["model=llama3_70b", *H100_96GB, *SEQ_8K, "launcher.nproc_per_node=8", "plan.measure=false"]
    args += ["parallelism=fsdp", "training.local_batch_size=2", "tracking=none"]
    out, [row] = plan(args, tmp_path)
    assert row["fits"] == "no" and row["fits with"], out
    assert "fewer ranks" not in out and "launcher.nodes=" in row["fits with"]
    for fix in row["fits with"].split(" or "):
        _, [fixed] = plan([*args, *fix.split()], tmp_path / fix.replace("=", "_").replace(" ", "_"))
        assert fixed["fits"] == "yes", (fix, fixed)


def test_debug_shapes_are_named_and_a_grid_shows_its_progress(tmp_path, capsys):
    args = ["-m", "model=llama3_8b", "hardware=h100", "launcher.nproc_per_node=8", "plan.measure=false"]
    assert plan_cli.main(["--out", str(tmp_path), *args, "activation_checkpoint.mode=none,full", "tracking=none"]) == 0
    out, err = capsys.readouterr()
    assert "debug training shapes" in out and "planned shapes: local batch 4 × seq 256" in out
    assert "planned 1 of 2" in err and "planned 2 of 2" in err and "s left)" in err


def test_plan_prune_and_the_preflight_print_the_same_figure_for_the_same_point(tmp_path, plan):
    """One memory model: the planner's reserved peak, plan.prune's and the pre-flight refusal's."""
    point = ["model=llama3_8b", *H100_96GB, *SEQ_8K, "launcher.nproc_per_node=8", "parallelism=fsdp"]
    point += ["training.local_batch_size=4", "plan.measure=false", "tracking=none"]
    _, [row] = plan(point, tmp_path)
    job = plan_point.compose_point(point)
    pruned = prune(to_job_config(compose_config([*point, "plan.prune=true"])))
    assert pruned is not None and f"predicted {row['peak GiB/rank']} GiB" in pruned.reason
    budget = Budget.of(job.config, 96 * GIB, False, "one GPU's memory")
    with pytest.raises(ConfigError) as refused:
        check_memory_fit(job, budget, "cuda")
    assert f"needs about {float(row['peak GiB/rank']):.1f} GiB" in str(refused.value)
    assert f"each can have {float(row['budget GiB']):.1f} GiB" in str(refused.value)


def test_one_config_is_predicted_recorded_and_compared_beside_its_measured_run(tmp_path, store, plan):
    uri, db = store
    layout = ["parallelism=fsdp", "launcher.nproc_per_node=2", "training.local_batch_size=4", "training.seq_len=128"]
    out, [row] = plan([*layout, uri], tmp_path)
    assert "peak memory per rank" in out and "optimizer state" in out and "tokens/s per device" in out
    assert "cross-check: the dry run's fake pass" in out and "(measured) + communication" in out  # which is which
    assert "planned shapes: local batch 4 × seq 128" in out
    assert row["layout"] == "fsdp2" and row["fits"] == "yes" and float(row["step s"]) > 0
    [prediction] = mlflow_runs(db)
    tags, metrics = prediction.data.tags, prediction.data.metrics
    assert tags["titan_exp.role"] == "prediction" and tags["layout"] == "fsdp2" and tags["hardware"] == "cpu"
    assert metrics["prediction/peak_memory_gib"] == pytest.approx(float(row["peak GiB/rank"]), abs=0.006)
    assert metrics["prediction/peak_reserved_gib"] > metrics["prediction/peak_active_gib"] > 0
    assert metrics["prediction/fake_pass_active_gib"] > 0
    assert metrics["prediction/tps_per_device"] > 0 and 0 < metrics["prediction/mfu_pct"] < 100

    trained = run_cli([*layout, "training.steps=4", "metrics.log_freq=1", "data=synthetic", uri], tmp_path / "run")
    assert trained.returncode == 0, trained.stderr[-3000:]
    [measured] = [r for r in mlflow_runs(db) if r.info.run_id != prediction.info.run_id]
    assert prediction.data.tags["layout_key"] == measured.data.tags["layout_key"]
    compared = subcommand(["compare", "--all", "--uri", uri.split("=", 1)[1], "--out", str(tmp_path / "cmp")])
    assert compared.returncode == 0, compared.stderr[-3000:]
    [row] = list(csv.DictReader(open(tmp_path / "cmp" / "strategy_table.csv")))
    assert row["run_id"] == measured.info.run_id  # the prediction is not a training run of its own
    predicted_tps = float(row["predicted_tps_per_device"])
    assert predicted_tps == pytest.approx(prediction.data.metrics["prediction/tps_per_device"])
    markdown = (tmp_path / "cmp" / "strategy_table.md").read_text()
    assert "predicted TPS/device" in markdown and "%)" in markdown  # the prediction's error


def test_prune_skips_points_predicted_not_to_fit_and_records_them(tmp_path, store):
    uri, db = store
    args = ["parallelism=fsdp", "launcher.nproc_per_node=2", "training.steps=2", "data=synthetic"]
    args += ["plan.prune=true", "plan.memory_budget_gib=0.5", "training.local_batch_size=1,64", uri]
    result = run_cli(args, tmp_path, flags=("-m",), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pruned: predicted" in result.stderr
    runs = {r.data.params.get("training.local_batch_size", r.data.tags.get("layout_key")): r for r in mlflow_runs(db)}
    pruned = [r for r in mlflow_runs(db) if r.data.tags.get("status") == "pruned"]
    assert len(pruned) == 1 and "batch64x" in pruned[0].data.tags["layout_key"]
    assert pruned[0].info.status == "KILLED" and pruned[0].data.metrics["prediction/peak_memory_gib"] > 0.5
    trained = [r for r in runs.values() if r.data.tags.get("status") == "finished"]
    assert [r.data.params["training.local_batch_size"] for r in trained] == ["1"]
    assert mlflow_client(db)  # the store is readable after the sweep


@pytest.mark.parametrize(
    "overrides,said",
    [
        (
            ["hardware=tpu"],
            "Could not find 'hardware/tpu' (options: a100, a10g, b200, cpu, gb200, h100, h100_grand_teton, h100_nvl, "
            "h100_pcie, h20, h200, l4, l40s, mi300x, mi325x)",
        ),
        (["parallelism=tp", "parallelism.tensor_parallel_degree=3"], "parallelism.tensor_parallel_degree=3"),
        (["hardware.peak_tflops_bf16=3"], "Could not override 'hardware.peak_tflops_bf16'"),
    ],
)
def test_a_bad_config_is_refused_in_one_line(overrides, said, capsys):
    assert plan_cli.main([*overrides, "tracking=none"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    [line] = err.strip().splitlines()
    assert line.startswith("titan_exp plan: config error:") and said in line


def test_the_command_line_runs_the_planner():
    result = subcommand(["plan", "hardware=tpu", "tracking=none"])
    assert result.returncode == 2 and result.stdout == ""
    assert (
        result.stderr.startswith("titan_exp plan: config error:") and "Could not find 'hardware/tpu'" in result.stderr
    )


@pytest.mark.parametrize("ranks, cost, stretch", [(2, 1.18, 1.0), (4, 1.18, 2 * 1.18), (4, 1.0, 2.0)])
def test_cpu_ranks_sharing_cores_stretch_by_their_share_and_the_profiles_time_sharing_cost(
    monkeypatch, ranks: int, cost: float, stretch: float
) -> None:
    """On 2 cores: 2 single-thread ranks have a core each; 4 share them, 2× their time alone and the
    `cpu` profile's measured cost of time-sharing beyond it (hardware.time_sharing_cost)."""
    monkeypatch.setattr(plan_point, "cpu_cores", lambda: 2)
    point = ["launcher.device=cpu", "launcher.oversubscribe=true", f"launcher.nproc_per_node={ranks}"]
    job = plan_point.compose_point([*point, "parallelism=fsdp", f"hardware.time_sharing_cost={cost}", "tracking=none"])
    assert job.placement.threads_per_rank == 1
    assert plan_point.cpu_ranks(job) == (1, pytest.approx(stretch))


def test_a_grid_over_tp_degrees_trains_the_same_tokens_per_step_at_every_point(tmp_path, plan):
    """The first point's tokens per step held across the grid (job/held_batch.py), shown as columns:
    each TP degree halves the data-parallel ranks and doubles the accumulation."""
    args = ["-m", "model=llama3_8b", *H100_96GB, *SEQ_8K, "launcher.nproc_per_node=8", "plan.measure=false"]
    args += ["parallelism=fsdp_tp", "parallelism.tensor_parallel_degree=1,2,4,8", "training.local_batch_size=2"]
    out, rows = plan([*args, "tracking=none"], tmp_path)
    assert "every point trains 131,072 tokens a step (16 sequences of 8192" in out
    by_tp = {r["overrides"]: r for r in rows}
    assert {r["global batch"] for r in rows} == {"16"} and {r["tokens/step"] for r in rows} == {"131,072"}
    assert [by_tp[f"parallelism.tensor_parallel_degree={tp}"]["accumulation"] for tp in (1, 2, 4, 8)] == [
        "1", "2", "4", "8"
    ]  # fmt: skip
    # Each keeping its local batch instead: the global batch follows the data-parallel degree.
    out, rows = plan([*args, "tracking=none", "sweep.batch=per_rank"], tmp_path / "local")
    assert "every point keeps its local batch (sweep.batch=per_rank)" in out
    assert sorted(int(r["global batch"]) for r in rows) == [2, 4, 8, 16] and {r["accumulation"] for r in rows} == {"1"}


def test_a_grid_point_that_cannot_train_the_held_batch_is_refused_naming_the_nearest(tmp_path, capsys):
    args = ["-m", "launcher.nproc_per_node=2,3", "plan.measure=false", "tracking=none", "hardware=h100"]
    args += ["training.local_batch_size=4"]
    assert plan_cli.main(["--out", str(tmp_path / "plan"), *args]) == 2
    said = capsys.readouterr().err
    assert (
        "training.global_batch_size=8: 8 sequences a step do not split over this point's 3 data-parallel ranks" in said
    )
    assert "every point can train 6 or 12 (set it)" in said and "(grid point: launcher.nproc_per_node=3)" in said
    assert not (tmp_path / "plan").exists()


def test_a_cpu_peak_measured_low_is_measured_again(tmp_path, plan):
    """A cached peak taken on a busy machine would put a plan's MFU above 100%: the plan measures it
    again and caches what beat it."""
    import json

    from titan_exp.metrics.peak_flops import cpu_name

    cache = tmp_path / "cache"
    cache.mkdir()
    low = {f"{cpu_name()}|torch.float32|threads=1": 1e6}  # 1 MFLOP/s: any timing beats it
    (cache / "cpu_peak_flops.json").write_text(json.dumps(low))
    args = ["launcher.nproc_per_node=2", "tracking=none", "plan.measure=false", f"data.cache_dir={cache}"]
    _, [row] = plan(args, tmp_path)
    assert 0 < float(row["MFU %"]) <= 100
    assert json.loads((cache / "cpu_peak_flops.json").read_text())[next(iter(low))] > 1e9


def test_compute_timed_without_the_cores_is_said_to_be_slow():
    """What the plan's timing got of its threads' time: a wait (another process on the core) is not
    work, and below 80% the plan says its compute figures are too slow."""
    import time

    from titan_exp.plan.measure import _CpuShare

    with _CpuShare(threads=1) as waited:
        time.sleep(0.3)
    with _CpuShare(threads=1) as worked:
        start = time.perf_counter()
        while time.perf_counter() - start < 0.3:
            pass
    assert waited.share < 0.2 and "plan again on an idle machine" in plan_cli.busy_caution([waited.share])
    assert worked.share > waited.share + 0.3 and plan_cli.busy_caution([1.0]) is None  # (beside other tests' ranks)


def test_a_grid_timed_on_a_busy_machine_says_so_once(tmp_path, plan, monkeypatch):
    """Two of three points' compute timed while other processes took the cores: one caution for the
    grid, naming how many and the least share, not one a point."""
    from titan_exp.plan import measure

    shares, timed = iter([0.5, 0.9, 0.3]), measure.measured_compute
    monkeypatch.setattr(measure, "measured_compute", lambda *args: (timed(*args)[0], next(shares)))
    args = ["launcher.nproc_per_node=2", "plan.measure=false", "tracking=none", "training.local_batch_size=1,2,4"]
    out, rows = plan(args, tmp_path)
    assert len(rows) == 3
    [caution] = [line for line in out.splitlines() if line.startswith("caution:")]
    assert "at 2 of 3 points this one got as little as 30% of its threads' time" in caution


@pytest.mark.slow  # a real `mlflow server` and a calibration through it: about 20 s
def test_calibrate_against_a_server_draws_no_download_progress_bars(tmp_path, monkeypatch):
    """A server's artifacts come over HTTP, where MLflow draws a progress bar for each file read (one
    a run, three lines each); `plan calibrate` reads each run's overrides and says nothing of it."""
    from mlflow.tracking import MlflowClient

    from launchers.rendezvous import free_port

    from conftest import start_mlflow_server, stop_mlflow_server

    # As a user's shell has it (a client opened in this process sets it: tracking/store.py).
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    port = free_port()
    server = start_mlflow_server(tmp_path / "server.db", port, tmp_path / "server.log")
    try:
        uri = f"http://127.0.0.1:{port}"
        client = MlflowClient(uri)
        experiment = client.create_experiment("titan_exp")  # the server's artifacts, over HTTP
        for layout, tps in (("ddp", 1000.0), ("fsdp", 900.0), ("tp", 700.0)):
            run_id = client.create_run(experiment, run_name=layout).info.run_id
            client.log_param(run_id, "derived/device_profile", "h100")
            client.log_metric(run_id, "throughput/tps_per_device_mean", tps, step=10)
            overrides = f"- model=llama3_debug\n- parallelism={layout}\n- launcher.nproc_per_node=2\n"
            client.log_text(run_id, overrides, "config/hydra/overrides.yaml")
            client.set_terminated(run_id, "FINISHED")
        done = subcommand(["plan", "calibrate", "--hardware", "h100", "--uri", uri, "--out", str(tmp_path / "h.yaml")])
    finally:
        stop_mlflow_server(server)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("| fitted on |") == 3 and "Downloading artifacts" not in done.stderr


@pytest.mark.slow  # the probe measures ~60 GEMMs and 25 collectives between two ranks: about 40 s
def test_plan_probe_writes_a_profile_whose_tables_price_the_plan(tmp_path, monkeypatch):
    """`plan probe` measures this machine for the debug model's shapes, writes a profile and its
    table into the user's config folder and records a run; `plan` on that profile without the
    per-layer measurement models compute from the table, and a table whose GEMMs run at half the
    rate gives a slower step."""
    import json

    monkeypatch.setenv("TITAN_EXP_CONFIG_DIR", str(tmp_path / "conf"))
    db = tmp_path / "mlflow.db"
    probed = subcommand(["plan", "probe", "--hardware", "cpu_here", f"tracking.uri=sqlite:///{db}"])
    assert probed.returncode == 0, probed.stderr[-3000:]
    folder = tmp_path / "conf" / "hardware"
    table = json.loads((folder / "cpu_here.kernels.json").read_text())
    assert table["provenance"] == "measured" and len(table["gemm"]) > 20 and len(table["collectives"]) == 25
    assert "kernel_tables: cpu_here.kernels.json" in (folder / "cpu_here.yaml").read_text()
    [run] = mlflow_runs(db)
    assert run.data.tags["titan_exp.role"] == "probe" and run.data.metrics["probe/elementwise_gbps"] > 0

    def step_seconds() -> float:
        shape = ["hardware=cpu_here", "plan.measure=false", "parallelism=fsdp", "launcher.nproc_per_node=2"]
        planned = subcommand(["plan", "--out", str(tmp_path / "plan"), *shape, "tracking=none"])
        assert planned.returncode == 0, planned.stderr[-3000:]
        assert "(modelled)" in planned.stdout and "compute" in planned.stdout
        return float(re.search(r"step ([\d.]+) s: compute", planned.stdout).group(1))

    measured = step_seconds()
    for point in table["gemm"]:
        point["tflops"] /= 2
    (folder / "cpu_here.kernels.json").write_text(json.dumps(table))
    assert step_seconds() > 1.3 * measured


def test_plan_probe_refuses_a_shipped_name_and_a_gpu_profile_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_EXP_CONFIG_DIR", str(tmp_path / "conf"))
    for args, said in [
        (["--hardware", "h100"], "a profile shipped with titan_exp has that name"),
        (["--hardware", "mine", "hardware=h100"], "probing a GPU's kernels"),
        (["--hardware", "../x"], "a profile's name is"),
    ]:
        result = subcommand(["plan", "probe", *args])
        assert result.returncode == 2 and said in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "conf").exists()

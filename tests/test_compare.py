"""The comparison's arithmetic, its columns and plots, and reading runs back, on their own (runs
built in memory with the params MLflow holds)."""

import csv

import pytest

from titan_exp import metric_names as names
from titan_exp.compare.report import NOT_READ, OVERSUBSCRIBED, columns, compare_sweep, table, write_report
from titan_exp.compare.runs import RunSummary, add_scaling_efficiency, best_first, parse_mesh, varying_params
from titan_exp.parallel.dims import ParallelDims
from titan_exp.tracking.config import TrackingConfig
from titan_exp.tracking.run import PARENT_TAG, ROLE_TAG, SWEEP_OVERRIDES_PARAM, UNREAD_KEYS_PARAM
from titan_exp.tracking.store import experiment_id

from conftest import compose_config, mlflow_client


def _summary(
    name: str,
    strategy: str,
    world_size: int,
    tps: float | None,
    mesh: dict[str, int],
    status: str = "FINISHED",
    **params: str,
) -> RunSummary:
    """A run as MLflow gives it back: its degrees among its params, as the resolved config has them."""
    degrees = {
        "parallelism.name": strategy,
        "parallelism.data_parallel_shard_degree": str(mesh.get("dp_shard", 1)),
        "parallelism.data_parallel_replicate_degree": str(mesh.get("dp_replicate", 1)),
        "parallelism.tensor_parallel_degree": str(mesh.get("tp", 1)),
        "launcher.nproc_per_node": str(world_size),
        "training.local_batch_size": "2",
    }
    return RunSummary(
        run_id=f"{name}-id-0123456789",
        name=name,
        status=status,
        mesh=mesh,
        device="cuda",
        world_size=world_size,
        tps_per_device=tps,
        mfu_pct=None if tps is None else tps / 100,
        peak_memory_gib=1.5,
        memory_kind="active",
        final_loss=2.0,
        params=degrees | params,
    )


def test_scaling_efficiency_is_relative_to_the_smallest_data_parallel_size_of_the_family():
    runs = [
        _summary("fsdp8", "fsdp", 8, 900.0, {"dp_shard": 8}),
        _summary("fsdp2-a", "fsdp", 2, 1000.0, {"dp_shard": 2}),
        _summary("fsdp2-b", "fsdp", 2, 1200.0, {"dp_shard": 2}),  # median of the baseline: 1100
        _summary("fsdp4tp2", "fsdp_tp", 8, 600.0, {"dp_shard": 4, "tp": 2}),
        _summary("fsdp2tp2", "fsdp_tp", 4, 800.0, {"dp_shard": 2, "tp": 2}),
        _summary("fsdp2tp4", "fsdp_tp", 8, 400.0, {"dp_shard": 2, "tp": 4}),  # another tp degree: alone
        _summary("ddp2", "ddp", 2, 1500.0, {"dp_replicate": 2}),  # another strategy at fsdp2's size: alone
        _summary("failed", "fsdp", 16, None, {"dp_shard": 16}, status="FAILED"),
        _summary("failed-fast", "fsdp", 1, 5000.0, {}, status="FAILED"),  # never a baseline
        # A different per-rank batch: a family of its own, with one size.
        _summary("other-batch", "fsdp", 4, 500.0, {"dp_shard": 4}, **{"training.local_batch_size": "1"}),
    ]
    add_scaling_efficiency(runs)
    efficiency = {r.name: r.scaling_efficiency for r in runs}
    assert efficiency["fsdp8"] == 900 / 1100
    assert efficiency["fsdp2-a"] == 1000 / 1100 and efficiency["fsdp2-b"] == 1200 / 1100
    assert efficiency["fsdp4tp2"] == 600 / 800 and efficiency["fsdp2tp2"] == 1.0
    for alone in ("fsdp2tp4", "ddp2", "failed", "failed-fast", "other-batch"):
        assert efficiency[alone] is None, alone


def test_runs_at_one_data_parallel_size_have_no_scaling_efficiency():
    """Three pipeline schedules at pp2: the same world size, different schedules, so nothing scales."""
    runs = [
        _summary(f"pp2·{schedule}", "pp", 2, tps, {"pp": 2}, **{"parallelism.pipeline_parallel_schedule": schedule})
        for schedule, tps in (("1F1B", 400.0), ("GPipe", 380.0), ("Interleaved1F1B", 300.0))
    ]
    add_scaling_efficiency(runs)
    assert [r.scaling_efficiency for r in runs] == [None, None, None]
    assert column(table(runs), "scaling efficiency") == ["", "", ""]


def test_where_the_ranks_ran_does_not_split_a_family():
    """Threads per rank differ between 1 and 2 ranks on one machine; FSDP's resharding is read at 2 only."""
    reshard = {"parallelism.fsdp_reshard_after_forward": "default"}
    one = _summary("single", "fsdp", 1, 1000.0, {}, **{"launcher.cpu_threads_per_rank": "2"}, **reshard)
    one.params[UNREAD_KEYS_PARAM] = "parallelism.fsdp_reshard_after_forward"
    two = _summary("fsdp2", "fsdp", 2, 900.0, {"dp_shard": 2}, **{"launcher.cpu_threads_per_rank": "1"}, **reshard)
    add_scaling_efficiency([one, two])
    assert (one.scaling_efficiency, two.scaling_efficiency) == (1.0, 0.9)


def column(rows: list[list[str]], name: str, varying: list[str] = ()) -> list[str]:
    return [row[columns(list(varying)).index(name)] for row in rows]


def test_the_table_has_a_column_for_each_key_that_differs_and_dashes_where_it_is_not_read():
    schedule = "parallelism.pipeline_parallel_schedule"
    runs = [
        _summary("pp2·1F1B", "pp", 2, 400.0, {"pp": 2}, **{schedule: "1F1B", "training.steps": "50"}),
        _summary("pp2·GPipe", "pp", 2, 380.0, {"pp": 2}, **{schedule: "GPipe", "training.steps": "50"}),
        # fsdp does not read the schedule (its rank says so in a param of its run).
        _summary("fsdp2", "fsdp", 2, 500.0, {"dp_shard": 2}, **{schedule: "GPipe", "training.steps": "50"}),
    ]
    runs[2].params[UNREAD_KEYS_PARAM] = f"{schedule},parallelism.context_parallel_impl"
    runs[2].params["tracking.parent_run_id"] = "elsewhere"  # bookkeeping, never a difference
    varying = varying_params(runs)
    # Degrees are in the run's name and world size: not columns of their own.
    assert varying == ["parallelism.name", schedule]
    rows = table(runs, varying)
    assert column(rows, schedule, varying) == ["1F1B", "GPipe", NOT_READ]
    assert column(rows, "parallelism.name", varying) == ["pp", "pp", "fsdp"]
    # Keys that only runs which do not read them set differently are no difference.
    assert varying_params(runs[1:]) == ["parallelism.name"]


def test_a_runs_own_checkpoint_folder_is_no_column():
    """Every run keeps its checkpoints in a folder of its own (<job folder>/checkpoints): a value of
    its own in every run, never a difference to show."""
    runs = [
        _summary(
            f"fsdp{n}", "fsdp", n, 500.0, {"dp_shard": n}, **{"checkpoint.folder": f"/out/multirun/{n}/checkpoints"}
        )
        for n in (1, 2)
    ]
    assert varying_params(runs) == []


def _log_point(client, experiment_id: str, parent_id: str, name: str, intervals: list[float]) -> None:
    """A finished sweep point as a run logs it: the TPS/device of each log interval (5 steps each),
    the steady mean from the second on (its first equal to the interval's own, as the meter logs it)."""
    from mlflow.entities import Metric

    run = client.create_run(experiment_id, run_name=name, tags={PARENT_TAG: parent_id})
    metrics = []
    for n, tps in enumerate(intervals):
        step, at = 5 * (n + 1), 1_000 + n
        metrics.append(Metric(names.TPS, tps, at, step))
        if n:
            steady = intervals[1 : n + 1]
            mean = tps if n == 1 else len(steady) / sum(1 / t for t in steady)
            metrics.append(Metric(names.TPS_MEAN, mean, at, step))
    client.log_batch(run.info.run_id, metrics=metrics)
    client.set_terminated(run.info.run_id, "FINISHED")


def test_a_sweeps_table_shows_each_runs_spread_and_which_runs_it_does_not_tell_apart(tmp_path, store):
    """Three points logged into a real store: ddp and fsdp within each other's spread (a), tp
    below both (b); the first interval (start-up) is in no spread. No point has a prediction: the
    note names the `plan` command of the sweep's overrides."""
    _, db = store
    uri = f"sqlite:///{db}"
    client = mlflow_client(db)
    experiment = experiment_id(client, TrackingConfig(uri=uri))
    parent = client.create_run(experiment, run_name="sweep: parallelism=ddp,fsdp,tp", tags={ROLE_TAG: "sweep"})
    client.log_param(parent.info.run_id, SWEEP_OVERRIDES_PARAM, "parallelism=ddp,fsdp,tp training.steps=30")
    _log_point(client, experiment, parent.info.run_id, "ddp2", [300.0, 1210.0, 1190.0, 1250.0, 1230.0, 1205.0])
    _log_point(client, experiment, parent.info.run_id, "fsdp2", [200.0, 1180.0, 1220.0, 1200.0, 1170.0, 1240.0])
    _log_point(client, experiment, parent.info.run_id, "tp2", [100.0, 900.0, 950.0, 1000.0, 920.0, 940.0])
    report = compare_sweep(uri, parent.info.run_id, tmp_path / "compare")
    with open(tmp_path / "compare" / "strategy_table.csv") as file:
        rows = {row["strategy"]: row for row in csv.DictReader(file)}
    assert list(rows) == ["ddp2", "fsdp2", "tp2"]  # best first
    assert {name: row["tps_group"] for name, row in rows.items()} == {"ddp2": "a", "fsdp2": "a", "tp2": "b"}
    assert {name: row["steady_intervals"] for name, row in rows.items()} == dict.fromkeys(rows, "5")
    assert float(rows["ddp2"]["tps_per_device_median"]) == 1210.0
    assert "| 1,210 (1,205–1,230, n=5) | a |" in report.markdown
    assert "`titan_exp plan parallelism=ddp,fsdp,tp training.steps=30` records one." in report.markdown


def test_the_csv_leaves_a_key_empty_where_the_run_does_not_read_it(tmp_path):
    schedule = "parallelism.pipeline_parallel_schedule"
    runs = [
        _summary("pp2·1F1B", "pp", 2, 400.0, {"pp": 2}, **{schedule: "1F1B"}),
        _summary("pp2·GPipe", "pp", 2, 380.0, {"pp": 2}, **{schedule: "GPipe"}),
        _summary("fsdp2", "fsdp", 2, 500.0, {"dp_shard": 2}, **{schedule: "GPipe"}),
    ]
    runs[2].params[UNREAD_KEYS_PARAM] = schedule
    write_report(runs, tmp_path, "t")
    with open(tmp_path / "strategy_table.csv") as file:
        cells = {row["strategy"]: row[schedule] for row in csv.DictReader(file)}
    assert cells == {"pp2·1F1B": "1F1B", "pp2·GPipe": "GPipe", "fsdp2": ""}


def test_best_first_puts_failed_runs_last_in_their_order():
    runs = [
        _summary("slow", "fsdp", 2, 100.0, {"dp_shard": 2}),
        _summary("failed-a", "fsdp", 2, None, {"dp_shard": 2}, status="FAILED"),
        _summary("fast", "fsdp", 2, 300.0, {"dp_shard": 2}),
        _summary("killed", "fsdp", 2, 900.0, {"dp_shard": 2}, status="KILLED"),  # its figure is not steady
        _summary("failed-b", "fsdp", 2, None, {"dp_shard": 2}, status="FAILED"),
    ]
    assert [r.name for r in best_first(runs)] == ["fast", "slow", "failed-a", "killed", "failed-b"]


@pytest.mark.parametrize("cpu_set,threads,flagged", [("0-1", "1", False), ("0", "1", True), ("0-3", "2", False)])
def test_cpu_runs_with_more_rank_threads_than_cores_are_flagged(cpu_set, threads, flagged):
    run = _summary("fsdp2", "fsdp", 2, 400.0, {"dp_shard": 2})
    run.device = "cpu"
    run.params |= {"derived/cpu_set": cpu_set, "launcher.cpu_threads_per_rank": threads}
    assert run.oversubscribed is flagged
    assert column(table([run]), "TPS/device")[0] == "400" + (f" ({OVERSUBSCRIBED})" if flagged else "")


def test_plots_show_scaling_only_where_there_is_some(tmp_path):
    same_size = [_summary(f"pp2-{n}", "pp", 2, 400.0 - n, {"pp": 2}) for n in range(3)]
    for run in same_size:
        run.loss_curve = [(1, 3.0), (2, 2.5), (3, 2.4)]
    report = write_report(same_size, tmp_path / "flat", "t")
    assert {p.name for p in report.files if p.suffix == ".png"} == {"loss_curves.png", "throughput.png", "memory.png"}
    scaled = [_summary("single", "fsdp", 1, 1000.0, {}), _summary("fsdp2", "fsdp", 2, 900.0, {"dp_shard": 2})]
    report = write_report(scaled, tmp_path / "scaled", "t")
    assert (tmp_path / "scaled" / "scaling.png") in report.files
    assert "scaling efficiency: TPS/device" in report.markdown  # the note under the table says what it is


def test_run_names_name_every_choice_that_changes_how_a_layout_runs():
    from omegaconf import OmegaConf

    from titan_exp.config.resolve import resolve

    def name(overrides: list[str]) -> str:
        return resolve(OmegaConf.to_object(compose_config(["launcher.oversubscribe=true", *overrides]))).run_name()

    assert name(["parallelism=fsdp", "launcher.nproc_per_node=2"]) == "llama3_debug·fsdp2"
    assert name(["parallelism=pp", "parallelism.pipeline_parallel_schedule=GPipe", "training.local_batch_size=4"]) == (
        "llama3_debug·pp2·GPipe·4mb"
    )
    assert name(["parallelism=single", "activation_checkpoint.mode=full", "compile.enable=true"]) == (
        "llama3_debug·single·ac_full·compile"
    )


def test_mesh_tags_read_back_into_degrees():
    assert parse_mesh("single") == {} and parse_mesh("") == {}
    assert parse_mesh("dp_replicate2·dp_shard4") == {"dp_replicate": 2, "dp_shard": 4}
    # Whatever ParallelDims writes into the `mesh` tag reads back as its degrees.
    dims = ParallelDims(pp=8, dp_replicate=2, dp_shard=16, cp=2, tp=8)
    assert parse_mesh(dims.describe()) == dims.mesh_shape()


def _share_of_color(png, color: str) -> float:
    """The share of the image's pixels within a small distance of `color` (a matplotlib colour)."""
    import matplotlib.colors
    import matplotlib.image
    import numpy as np

    pixels = matplotlib.image.imread(png)[..., :3]
    target = np.array(matplotlib.colors.to_rgb(color))
    return float((np.abs(pixels - target).max(axis=-1) < 0.08).mean())


def test_equal_curves_both_stay_visible(tmp_path):
    """fsdp and ddp train the same loss: the second curve drawn must not hide the first."""
    from titan_exp.compare.plots import overlay

    curve = [(step, 8.0 - 0.1 * step) for step in range(1, 31)]
    overlay({"fsdp2": curve, "ddp2": curve}, tmp_path / "loss.png", "Loss curves", "loss")
    assert _share_of_color(tmp_path / "loss.png", "C0") > 0.001 and _share_of_color(tmp_path / "loss.png", "C1") > 0.001


def test_the_parity_plot_shows_each_layouts_deviation_against_the_tolerance_band(tmp_path):
    """What parity is about: deviations from the reference inside the band ±rtol, drawn so (its green
    band), beside the curves; a legend of nine long names fits the image."""
    from titan_exp.compare.plots import parity

    curve = [8.0 - 0.1 * step for step in range(30)]
    layouts = {f"fsdp2·tp2·ep2·etp2 layout number {n}": [v * (1 + 1e-7 * n) for v in curve] for n in range(9)}
    parity(layouts, 1e-5, tmp_path / "parity.png", "Loss parity")
    import matplotlib.colors

    green = matplotlib.colors.to_rgb("green")
    band = tuple(1 - 0.12 * (1 - c) for c in green)  # the band over white, at its alpha 0.12
    assert _share_of_color(tmp_path / "parity.png", band) > 0.05

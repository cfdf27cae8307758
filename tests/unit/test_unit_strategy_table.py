"""titan_exp/compare/report.py's strategy table from in-memory RunSummary objects (no MLflow):
row order and width, the formatting of each column, predictions beside measurements, and the
Markdown, HTML and CSV renderings."""

import csv
from pathlib import Path

from titan_exp.compare.report import (
    COLUMNS,
    CSV_COLUMNS,
    SPREAD_NOTE,
    columns,
    notes,
    table,
    to_html,
    to_markdown,
    write_csv,
)
from titan_exp.compare.runs import RunSummary, add_scaling_efficiency, add_tps_groups


def summary(name: str, world_size: int = 2, tps: float | None = 1000.0, **fields: object) -> RunSummary:
    values: dict[str, object] = dict(
        run_id=f"{name}-0123456789abcdef",
        name=name,
        status="FINISHED",
        mesh={"dp_shard": world_size},
        device="cuda",
        world_size=world_size,
        tps_per_device=tps,
        mfu_pct=None if tps is None else 41.256,
        peak_memory_gib=3.14159,
        memory_kind="active",
        final_loss=2.718281,
        params={
            "training.global_batch_size": "16",
            "derived/global_batch_tokens": "4096",
            "derived/gradient_accumulation_steps": "2",
        },
    )
    return RunSummary(**(values | fields))


def column(rows: list[list[str]], name: str) -> list[str]:
    return [row[COLUMNS.index(name)] for row in rows]


def test_rows_keep_the_runs_order_and_fill_every_column() -> None:
    runs = [summary("zeta", 8), summary("alpha", 2), summary("mid", 4)]
    rows = table(runs)
    assert column(rows, "strategy") == ["zeta", "alpha", "mid"]
    assert column(rows, "world size") == ["8", "2", "4"]
    assert all(len(row) == len(COLUMNS) for row in rows)


def test_cells_are_formatted() -> None:
    run = summary("fsdp2", tps=12345.67, validation_loss=2.5)
    add_scaling_efficiency([run])
    [row] = table([run])
    cells = dict(zip(COLUMNS, row))
    assert cells["TPS/device"] == "12,346"
    assert cells["MFU %"] == "41.26"
    assert cells["peak memory GiB"] == "3.14 (active)"
    assert cells["scaling efficiency"] == ""  # no other data-parallel size: nothing to scale from
    assert cells["final loss"] == "2.7183" and cells["validation loss"] == "2.5000"
    assert cells["status"] == "FINISHED"
    assert cells["run"] == "fsdp2-01"  # the run id's first 8 characters
    assert cells["predicted TPS/device"] == cells["predicted peak GiB"] == "n/a"


def test_moe_runs_show_their_expert_load_beside_the_memory() -> None:
    """A column only where a run has experts; a dense run beside MoE ones reads n/a there."""
    assert "experts max/mean" not in columns([])
    runs = [summary("fsdp2·ep2", expert_load_imbalance=1.384), summary("fsdp2")]
    header = columns(["parallelism.expert_parallel_degree"], moe=True)
    assert header.index("experts max/mean") == header.index("predicted peak GiB") + 1
    rows = table(runs, ["parallelism.expert_parallel_degree"])
    assert [dict(zip(header, row))["experts max/mean"] for row in rows] == ["1.38", "n/a"]
    assert all(len(row) == len(header) for row in rows)


def test_missing_figures_read_n_a() -> None:
    run = summary("failed", tps=None, status="FAILED", peak_memory_gib=None, final_loss=None)
    cells = dict(zip(COLUMNS, table([run])[0]))
    for name in ("TPS/device", "MFU %", "peak memory GiB", "final loss"):
        assert cells[name] == "n/a", name
    assert cells["scaling efficiency"] == cells["validation loss"] == ""


def test_predictions_show_their_error_against_the_measurement() -> None:
    """Predicted 1500 TPS against 1200 measured: +25%; 2.5 GiB against 2.0: +25%; 900 against 1200: -25%."""
    over = summary(
        "over", tps=1200.0, peak_memory_gib=2.0, predicted_tps_per_device=1500.0, predicted_peak_memory_gib=2.5
    )
    under = summary("under", tps=1200.0, predicted_tps_per_device=900.0)
    rows = table([over, under])
    assert column(rows, "predicted TPS/device") == ["1,500 (+25%)", "900 (-25%)"]
    assert column(rows, "predicted peak GiB")[0] == "2.50 (+25%)"


def test_a_prediction_without_a_comparable_measurement_has_no_error() -> None:
    """No measured TPS (a failed run); a CPU resident-set peak (not comparable with tensor counts)."""
    failed = summary("failed", tps=None, predicted_tps_per_device=1500.0)
    cpu = summary("cpu", memory_kind="cpu rss", predicted_peak_memory_gib=2.5)
    rows = table([failed, cpu])
    assert column(rows, "predicted TPS/device")[0] == "1,500"
    assert column(rows, "predicted peak GiB")[1] == "2.50"
    assert column(rows, "peak memory GiB")[1] == "3.14 (cpu rss)"


def test_failure_reason_joins_the_status_cut_at_80_characters() -> None:
    run = summary("f", status="FAILED", failure_reason="RankFailure: " + "x" * 200)
    status = column(table([run]), "status")[0]
    assert status == "FAILED: " + ("RankFailure: " + "x" * 200)[:80]


def test_scaling_efficiency_in_the_table() -> None:
    """Relative to the family's smallest world size: 800 at 4 ranks over 1000 at 2."""
    runs = [summary("two", 2, 1000.0), summary("four", 4, 800.0)]
    add_scaling_efficiency(runs)
    assert column(table(runs), "scaling efficiency") == ["1.00", "0.80"]


def test_markdown_header_separator_rows_and_escaping() -> None:
    rows = table([summary("a|b"), summary("c")])
    lines = to_markdown(rows).splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    assert lines[1] == "|" + "---|" * len(COLUMNS)
    assert len(lines) == 2 + len(rows)
    assert lines[2].startswith("| a\\|b | 2 | 16 | 4,096 | 2 | 1,000 |  |  | n/a | 41.26 |")
    # Every row has as many unescaped separators as the header.
    assert {line.replace("\\|", "").count("|") for line in lines} == {len(COLUMNS) + 1}


def test_markdown_with_other_columns() -> None:
    assert to_markdown([["1", "2"]], ["x", "y"]) == "| x | y |\n|---|---|\n| 1 | 2 |\n"


def test_html_escapes_cells_and_title() -> None:
    page = to_html(table([summary("<b>&")]), "fsdp <vs> tp")
    assert "<title>fsdp &lt;vs&gt; tp</title>" in page and "<h1>fsdp &lt;vs&gt; tp</h1>" in page
    assert "<td>&lt;b&gt;&amp;</td>" in page and "<b>&" not in page
    assert page.count("<th>") == len(COLUMNS) and page.count("<tr>") == 2


def test_csv_holds_plain_numbers_and_empty_cells_for_none(tmp_path: Path) -> None:
    runs = [summary("fsdp2", tps=12345.678, predicted_tps_per_device=11111.5), summary("failed", tps=None)]
    write_csv(runs, tmp_path / "t.csv")
    with open(tmp_path / "t.csv", newline="") as file:
        header, *rows = list(csv.reader(file))
    assert header == CSV_COLUMNS and len(rows) == 2
    first, second = (dict(zip(header, row)) for row in rows)
    assert first["tps_per_device"] == "12345.678" and first["predicted_tps_per_device"] == "11111.5"
    assert first["run_id"] == "fsdp2-0123456789abcdef" and first["memory_kind"] == "active"
    assert second["tps_per_device"] == second["mfu_pct"] == second["scaling_efficiency"] == ""


def test_the_mlflow_view_adds_the_expert_load_where_a_run_has_experts() -> None:
    from types import SimpleNamespace

    from titan_exp.compare.ui_view import EXPERT_LOAD_COLUMN, STRATEGY_COLUMNS, strategy_columns

    def run(**metrics: float) -> SimpleNamespace:
        return SimpleNamespace(data=SimpleNamespace(metrics=metrics, tags={}))

    assert strategy_columns([run()]) == list(STRATEGY_COLUMNS)  # a column no run has would stay empty
    columns = strategy_columns([run(), run(**{"moe/load_imbalance": 1.4})])
    assert columns.index(EXPERT_LOAD_COLUMN) == columns.index("metrics.`loss/global_avg`") - 1
    assert [c for c in columns if c != EXPERT_LOAD_COLUMN] == list(STRATEGY_COLUMNS)


def test_each_run_shows_the_median_and_quartiles_of_its_steady_intervals() -> None:
    """Five intervals: quartiles by the inclusive method (1,000 and 1,200 around 1,100); two give no spread."""
    spread = summary("five", steady_tps=[1300.0, 900.0, 1100.0, 1000.0, 1200.0])
    short = summary("two", steady_tps=[1000.0, 1100.0])
    rows = table([spread, short])
    assert column(rows, "TPS/device median (IQR)") == ["1,100 (1,000–1,200, n=5)", ""]
    assert notes([spread, short], [])[0] == SPREAD_NOTE
    assert SPREAD_NOTE not in notes([short], [])


def steady(name: str, low: float, high: float, **fields: object) -> RunSummary:
    """A run whose steady intervals' quartiles are `low` and `high` (five intervals, evenly spread)."""
    step = (high - low) / 2
    return summary(name, tps=low + step, steady_tps=[low - step, low, low + step, high, high + step], **fields)


def test_runs_whose_quartiles_overlap_share_a_letter_and_the_others_differ() -> None:
    """first overlaps second, second overlaps third, first and third do not: a, ab, b; fourth stands
    apart (c). A failed run and one without a spread are in no group."""
    runs = [
        steady("first", 1200.0, 1300.0),
        steady("second", 1150.0, 1250.0),
        steady("third", 1000.0, 1160.0),
        steady("fourth", 700.0, 800.0),
        steady("failed", 1200.0, 1300.0, status="FAILED"),
        summary("short", steady_tps=[1200.0, 1250.0]),
    ]
    add_tps_groups(runs)
    assert column(table(runs), "TPS group") == ["a", "ab", "b", "c", "", ""]


def test_more_groups_than_letters_go_on_as_a_spreadsheets_columns() -> None:
    runs = [steady(f"r{n}", 1000.0 - 10 * n, 1004.0 - 10 * n) for n in range(28)]
    add_tps_groups(runs)
    assert [r.tps_group for r in runs[24:]] == ["y", "z", "aa", "ab"]
    runs.insert(1, steady("between", 993.0, 1001.0))  # in the first group and the second
    add_tps_groups(runs)
    assert [r.tps_group for r in runs[:3]] == ["a", "a,b", "b"]


def test_a_missing_prediction_says_which_plan_command_records_it() -> None:
    planned = summary("planned", predicted_tps_per_device=900.0)
    unplanned = summary("unplanned")
    assert column(table([unplanned]), "predicted TPS/device") == ["n/a"]
    [said] = [n for n in notes([planned, unplanned], [], "`titan_exp plan x=1,2`") if n.startswith("n/a")]
    assert said.endswith("`titan_exp plan x=1,2` records one.")
    assert not [n for n in notes([planned], []) if "titan_exp plan" in n]
    assert "config/hydra/overrides.yaml" in "".join(notes([unplanned], []))  # without a sweep's overrides


def test_the_csv_holds_the_quartiles_and_the_group(tmp_path: Path) -> None:
    run = steady("spread", 1000.0, 1200.0)
    add_tps_groups([run])
    write_csv([run, summary("short")], tmp_path / "t.csv")
    with open(tmp_path / "t.csv", newline="") as file:
        first, second = csv.DictReader(file)
    assert [first[k] for k in ("tps_per_device_q1", "tps_per_device_median", "tps_per_device_q3")] == [
        "1000.0",
        "1100.0",
        "1200.0",
    ]
    assert first["steady_intervals"] == "5" and first["tps_group"] == "a"
    assert second["tps_per_device_median"] == second["tps_group"] == "" and second["steady_intervals"] == "0"


def test_the_mlflow_charts_overlay_each_intervals_tps_beside_the_steady_bars() -> None:
    """The UI's view shows the spread the table gives as quartiles: each log interval's TPS/device."""
    from titan_exp.compare.ui_view import STRATEGY_CHARTS

    charts = [(kind, metric) for kind, metric, _ in STRATEGY_CHARTS]
    assert ("LINE", "throughput/tps_per_device") in charts and ("BAR", "throughput/tps_per_device_mean") in charts

"""The strategy table's arithmetic and formats, and reading runs back, on their own."""

import csv

from titan_exp.compare.report import COLUMNS, table, to_html, to_markdown, write_csv
from titan_exp.compare.runs import RunSummary, add_scaling_efficiency, parse_mesh
from titan_exp.parallel.dims import ParallelDims


def _summary(
    name: str, strategy: str, world_size: int, tps: float | None, mesh: dict[str, int], status: str = "FINISHED"
) -> RunSummary:
    return RunSummary(
        run_id=f"{name}-id-0123456789",
        name=name,
        status=status,
        model="llama3_8b",
        strategy=strategy,
        quantize="none",
        mesh=mesh,
        device="cuda",
        tokens_per_micro_batch=8192,
        world_size=world_size,
        tps_per_device=tps,
        mfu_pct=None if tps is None else tps / 100,
        peak_memory_gib=1.5,
        memory_kind="active",
        final_loss=2.0,
    )


def test_scaling_efficiency_is_relative_to_the_smallest_world_size_of_the_family():
    runs = [
        _summary("fsdp8", "fsdp", 8, 900.0, {"dp_shard": 8}),
        _summary("fsdp2-a", "fsdp", 2, 1000.0, {"dp_shard": 2}),
        _summary("fsdp2-b", "fsdp", 2, 1200.0, {"dp_shard": 2}),  # median of the baseline: 1100
        _summary("fsdp4tp2", "fsdp_tp", 8, 600.0, {"dp_shard": 4, "tp": 2}),
        _summary("fsdp2tp2", "fsdp_tp", 4, 800.0, {"dp_shard": 2, "tp": 2}),
        _summary("fsdp2tp4", "fsdp_tp", 8, 400.0, {"dp_shard": 2, "tp": 4}),  # another tp degree: its own family
        _summary("failed", "fsdp", 16, None, {"dp_shard": 16}, status="FAILED"),
        _summary("failed-fast", "fsdp", 1, 5000.0, {}, status="FAILED"),  # never a baseline
    ]
    runs.append(_summary("other-batch", "fsdp", 4, 500.0, {"dp_shard": 4}))
    runs[-1].tokens_per_micro_batch = 4096  # a different per-rank batch: a family of its own
    add_scaling_efficiency(runs)
    efficiency = {r.name: r.scaling_efficiency for r in runs}
    assert efficiency["fsdp8"] == 900 / 1100
    assert efficiency["fsdp2-a"] == 1000 / 1100 and efficiency["fsdp2-b"] == 1200 / 1100
    assert efficiency["fsdp4tp2"] == 600 / 800 and efficiency["fsdp2tp2"] == 1.0
    assert efficiency["fsdp2tp4"] == 1.0
    assert efficiency["failed"] is None and efficiency["failed-fast"] is None
    assert efficiency["other-batch"] == 1.0


def test_table_formats_agree_and_escape(tmp_path):
    run = _summary("a|b<c>", "fsdp", 2, 1234.5, {"dp_shard": 2})
    failed = _summary("f", "fsdp", 4, None, {"dp_shard": 4}, status="FAILED")
    failed.failure_reason = "RankFailure: rank 1 failed"
    run.predicted_tps_per_device, run.predicted_peak_memory_gib = 1111.05, 1.65  # python -m titan_exp plan's
    add_scaling_efficiency([run, failed])
    rows = table([run, failed])
    expected = ["a|b<c>", "2", "1,234", "1,111 (-10%)", "12.35", "1.50 (active)", "1.65 (+10%)", "1.00", "2.0000"]
    assert rows[0] == [*expected, "FINISHED", "a|b<c>-i"]
    assert rows[1][2] == "n/a" and rows[1][3] == "n/a" and rows[1][7] == "n/a"
    assert rows[1][9] == "FAILED: RankFailure: rank 1 failed"
    markdown = to_markdown(rows).splitlines()
    assert markdown[0] == "| " + " | ".join(COLUMNS) + " |" and markdown[2].startswith("| a\\|b<c> | 2 | 1,234 |")
    assert "<td>a|b&lt;c&gt;</td>" in to_html(rows, "t")
    write_csv([run, failed], tmp_path / "t.csv")
    with open(tmp_path / "t.csv") as file:
        written = list(csv.DictReader(file))
    assert float(written[0]["tps_per_device"]) == 1234.5 and float(written[0]["scaling_efficiency"]) == 1.0
    assert float(written[0]["predicted_tps_per_device"]) == 1111.05 and written[1]["predicted_tps_per_device"] == ""
    assert written[1]["tps_per_device"] == "" and written[1]["failure_reason"] == "RankFailure: rank 1 failed"


def test_mesh_tags_read_back_into_degrees():
    assert parse_mesh("single") == {} and parse_mesh("") == {}
    assert parse_mesh("dp_replicate2·dp_shard4") == {"dp_replicate": 2, "dp_shard": 4}
    # Whatever ParallelDims writes into the `mesh` tag reads back as its degrees.
    dims = ParallelDims(pp=8, dp_replicate=2, dp_shard=16, cp=2, tp=8)
    assert parse_mesh(dims.describe()) == dims.mesh_shape()

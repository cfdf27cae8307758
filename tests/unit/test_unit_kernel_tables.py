"""estimate/kernel_tables.py: lookups between measured points, what a table file may hold, and a
profile's tables changing the op model's prices the way their figures say."""

import dataclasses
import json

import pytest
from layouts import layout

from titan_exp.estimate.collectives import collective_seconds
from titan_exp.estimate.config import HardwareConfig
from titan_exp.estimate.gpu_compute import _linear, block_seconds
from titan_exp.estimate.hardware_profiles import hardware_profiles
from titan_exp.estimate.kernel_tables import CollectivePoint, GemmPoint, KernelTables, read_tables
from titan_exp.estimate.workload import Workload
from titan_exp.models.config import ModelConfig
from titan_exp.parallel.config import ActivationCheckpointConfig
from titan_exp.rules import ConfigError

TABLES = KernelTables(
    "test",
    "measured",
    gemm=(GemmPoint(1024, 1024, 1024, "bfloat16", 600.0), GemmPoint(4096, 4096, 4096, "bfloat16", 800.0)),
    collectives=(
        CollectivePoint("all_gather", 1e6, 8, False, 10e-6),
        CollectivePoint("all_gather", 1e8, 8, False, 310e-6),
        CollectivePoint("all_gather", 1e8, 16, True, 2e-3),
    ),
)


def test_a_measured_shape_returns_its_own_rate_and_others_lie_between_their_neighbours() -> None:
    assert TABLES.gemm_tflops(1024, 1024, 1024, "bfloat16") == 600.0
    assert 600.0 < TABLES.gemm_tflops(2048, 2048, 2048, "bfloat16") < 800.0
    assert TABLES.gemm_tflops(2048, 2048, 2048, "float32") is None  # no point in that dtype


def test_a_collective_interpolates_in_bytes_at_the_nearest_rank_count_of_its_placement() -> None:
    # Halfway in bytes between 1 MB and 100 MB: halfway in time (latency plus bandwidth between them).
    assert TABLES.collective_seconds("all_gather", 50.5e6, 8, False) == pytest.approx(160e-6)
    assert TABLES.collective_seconds("all_gather", 1e3, 4, False) == 10e-6  # below: the smallest's latency
    assert TABLES.collective_seconds("all_gather", 2e8, 8, False) == pytest.approx(620e-6)  # beyond: its busbw
    assert TABLES.collective_seconds("all_gather", 1e8, 16, True) == 2e-3
    assert TABLES.collective_seconds("reduce_scatter", 1e8, 8, False) is None


def test_a_profile_with_tables_prices_its_gemms_and_collectives_from_them(tmp_path) -> None:
    """H100 with a table whose GEMMs run at half the rate of the scalar model's and whose all-gather
    is given: the block's matmul time doubles where the table holds its shapes; the collective is
    the table's."""
    h100 = hardware_profiles()["h100"]
    m = ModelConfig(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, vocab_size=1024, ffn_dim_multiplier=1.0)
    w = Workload(m, layout(), ActivationCheckpointConfig(mode="none"), 1, 4096, param_dtype="bfloat16")
    shapes = {(4096, 4096, 4096), (4096, 1024, 4096), (4096, 4096, 1024), (4096, 14336, 4096), (4096, 4096, 14336)}
    scalar_rate = h100.peak_tflops_bfloat16 * h100.matmul_efficiency
    half = [{"m": a, "n": b, "k": c, "dtype": "bfloat16", "tflops": scalar_rate / 2} for a, b, c in shapes]
    gather = {"op": "all_gather", "bytes": 1e8, "ranks": 8, "across_nodes": False, "seconds": 0.5}
    path = tmp_path / "t.kernels.json"
    path.write_text(json.dumps({"source": "a test", "provenance": "measured", "gemm": half, "collectives": [gather]}))
    with_tables = dataclasses.replace(h100, kernel_tables=str(path))
    with_tables.check("hardware")
    # wq over the microbatch's 4096 tokens: its three GEMMs, each (4096, 4096, 4096), at the table's
    # rate (the scalar model's also loses 3% to its last partial wave of tiles).
    gemm = 2 * 4096**3 / (scalar_rate / 2 * 1e12)
    assert _linear(with_tables, w, 4096, 4096, 4096) == pytest.approx((gemm, 2 * gemm), rel=1e-9)
    assert _linear(h100, w, 4096, 4096, 4096)[0] == pytest.approx(gemm / 2 / 0.97, rel=0.01)
    assert block_seconds(with_tables, w)["forward"] > 1.5 * block_seconds(h100, w)["forward"]
    assert collective_seconds(with_tables, 1e8, 8, 1, "all_gather") == 0.5
    assert collective_seconds(h100, 1e8, 8, 1, "all_gather") < 0.01


ONE_GEMM = {"m": 1, "n": 1, "k": 1, "dtype": "bfloat16", "tflops": 1.0}


@pytest.mark.parametrize(
    "entry, said",
    [
        ({"provenance": "measured"}, "exactly provenance, source"),
        ({"source": "x", "provenance": "fitted"}, "must be one of measured, published, unmeasured"),
        ({"source": "x", "provenance": "measured", "gemm": [{**ONE_GEMM, "tflops": -1}]}, "gemm[0].tflops"),
        ({"source": "x", "provenance": "measured", "gemm": [{**ONE_GEMM, "dtype": "int4"}]}, "gemm[0].dtype"),
        ({"source": "x", "provenance": "measured",
          "collectives": [{"op": "all_gather", "bytes": 1, "ranks": 2, "across_nodes": 1, "seconds": 1}]},
         "across_nodes"),
        ({"source": "x\x1b[2J", "provenance": "measured"}, "plain text"),
    ],
)  # fmt: skip
def test_a_table_file_is_read_as_data_and_refused_in_one_line(tmp_path, entry, said) -> None:
    path = tmp_path / "bad.kernels.json"
    path.write_text(json.dumps(entry))
    with pytest.raises(ValueError, match=r".*") as raised:
        read_tables(path)
    assert said in str(raised.value) and str(path) in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match="hardware.kernel_tables"):
        HardwareConfig(name="x", kernel_tables=str(path)).check("hardware")

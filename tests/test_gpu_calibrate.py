"""benchmarks/gpu_calibrate.py where there is no GPU: --dry composes the points and writes the
planner's figures; without --dry it refuses in one line. Its runs on a GPU: benchmarks/gpu_calibrate.sh."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

POINTS = ["1b_ac_full", "8b4l_compile_float8"]
PREDICTED = ("pred active GiB", "pred reserved GiB", "pred TPS/device", "pred MFU %")
MEASURED = ("active GiB", "reserved GiB", "TPS/device", "MFU %")


def calibrate(args: list[str]) -> subprocess.CompletedProcess:
    # No GPU for the script even on a machine that has one: the refusal is what is tested.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_calibrate.py"), *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_dry_run_writes_the_points_predicted_figures(tmp_path: Path):
    result = calibrate(["--dry", "--hardware", "h200", "--only", *POINTS, "--out", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "calibration.csv") as f:
        rows = {row["point"]: row for row in csv.DictReader(f)}
    assert list(rows) == POINTS
    for row in rows.values():
        assert row["status"] == "dry"
        assert all(float(row[column]) > 0 for column in PREDICTED), row
        assert all(row[column] == "" for column in MEASURED), row
    markdown = (tmp_path / "calibration.md").read_text()
    assert "hardware=h200" in markdown and all(f"| {point} | dry |" in markdown for point in POINTS)
    report = json.loads((tmp_path / "calibration.json").read_text())
    assert report["points"]["8b4l_compile_float8"]["predicted"]["tps"] > 0
    assert "quantize=float8" in report["points"]["8b4l_compile_float8"]["overrides"]
    summary = json.loads(result.stdout.splitlines()[-1])  # the closing JSON line
    assert summary["dry"] and summary["hardware"] == "h200" and summary["failed"] == []


def test_without_a_gpu_it_refuses_in_one_line(tmp_path: Path):
    result = calibrate(["--only", "1b", "--out", str(tmp_path / "out")])
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("gpu_calibrate: no CUDA device") and "--dry" in line
    assert not (tmp_path / "out").exists()  # refused before anything was written

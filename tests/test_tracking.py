"""Tracking and comparison against real MLflow stores: a `mlflow server` on loopback read back over
REST, its UI in headless Chromium, a SQLite store shared by four jobs, sweeps as parent + child
runs, and the strategy table computed from what the runs logged."""

import csv
import html
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from launchers.env import free_port

from conftest import (
    REPO,
    SMALL_MODEL,
    chromium,
    mlflow_client,
    mlflow_runs,
    run_cli,
    start_mlflow_server,
    stop_mlflow_server,
)

SMOKE = ["experiment=smoke", "tracking=mlflow", "launcher.device=cpu", *SMALL_MODEL]
# Where tests leave files for people to look at (git-ignored); CI can collect them.
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS_DIR", REPO / "outputs" / "test-artifacts"))


def _rest(base: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        f"{base}/api/2.0/mlflow/{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`titan_exp ui` (a real `mlflow server`) on 127.0.0.1 over a fresh SQLite store; yields its URL."""
    root = tmp_path_factory.mktemp("server")
    port = free_port()
    server = start_mlflow_server(root / "mlflow.db", port, root / "server.log")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_mlflow_server(server)


@pytest.fixture(scope="module")
def server_sweep(mlflow_server, tmp_path_factory):
    """A 2-point sweep that tracks over HTTP into the server; yields (server URL, experiment id)."""
    tmp = tmp_path_factory.mktemp("sweep")
    result = run_cli(
        [*SMOKE, f"tracking.uri={mlflow_server}", "training.steps=3", "parallelism=ddp,fsdp"], tmp, flags=("-m",)
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    experiment = _rest(mlflow_server, "experiments/get-by-name?experiment_name=titan_exp")["experiment"]
    return mlflow_server, experiment["experiment_id"]


def test_a_parent_run_the_server_does_not_have_is_refused(server_sweep):
    from titan_exp.config.compose import to_job_config
    from titan_exp.config.resolve import resolve
    from titan_exp.job.preflight import preflight
    from titan_exp.rules import ConfigError

    from conftest import compose_config

    url, experiment_id = server_sweep
    [run, *_] = _rest(url, "runs/search", {"experiment_ids": [experiment_id]})["runs"]

    def check(parent: str) -> None:
        preflight(resolve(to_job_config(compose_config([f"tracking.uri={url}", f"tracking.parent_run_id={parent}"]))))

    check(run["info"]["run_id"])
    with pytest.raises(ConfigError, match=f"no such run in {url}"):
        check("0123abcd")


def test_sweep_tracked_over_http_reads_back_through_the_rest_api(server_sweep):
    url, experiment_id = server_sweep
    runs = _rest(url, "runs/search", {"experiment_ids": [experiment_id]})["runs"]
    tags = {run["info"]["run_id"]: {t["key"]: t["value"] for t in run["data"].get("tags", [])} for run in runs}
    [parent] = [r for r in runs if tags[r["info"]["run_id"]].get("titan_exp.role") == "sweep"]
    children = [r for r in runs if r is not parent]
    parent_id = parent["info"]["run_id"]
    assert parent["info"]["status"] == "FINISHED" and parent["info"]["run_name"] == "sweep: parallelism=ddp,fsdp"
    assert "compare/strategy_table.html" in tags[parent_id]["mlflow.note.content"]  # its Overview says where
    experiment = _rest(url, f"experiments/get?experiment_id={experiment_id}")["experiment"]
    assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in experiment["tags"]
    assert sorted(r["info"]["run_name"] for r in children) == ["llama3_debug·ddp2", "llama3_debug·fsdp2"]
    for child in children:
        child_id = child["info"]["run_id"]
        assert child["info"]["status"] == "FINISHED"
        assert tags[child_id]["mlflow.parentRunId"] == parent_id
        history = _rest(url, f"metrics/get-history?run_id={child_id}&metric_key=loss/global_avg")["metrics"]
        assert sorted(m["step"] for m in history) == [1, 2, 3]
        logs = _rest(url, f"artifacts/list?run_id={child_id}&path=logs")["files"]
        assert [f["path"] for f in logs] == ["logs/rank0.log"]
    compare = {f["path"] for f in _rest(url, f"artifacts/list?run_id={parent_id}&path=compare")["files"]}
    assert {
        "compare/strategy_table.html",
        "compare/strategy_table.csv",
        "compare/loss_curves.png",
    } <= compare
    # ddp2 and fsdp2 share a world size: there is no scaling to plot, and no plot pretends there is.
    assert "compare/scaling.png" not in compare


def _page_text(url: str, *flags: str) -> str:
    """The text a reader sees on the page once its scripts have run (tags stripped, spaces collapsed)."""
    dom = chromium(*flags, "--dump-dom", url).stdout
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", dom)).split())


def test_a_new_browser_opens_the_experiment_on_model_training_not_genai(server_sweep, tmp_path):
    url, experiment_id = server_sweep
    # The experiment's own address, no workflowType in it, in a browser profile that has chosen nothing.
    text = _page_text(f"{url}/#/experiments/{experiment_id}", f"--user-data-dir={tmp_path / 'profile'}")
    # A plain `mlflow server` opens this address on "Overview - Experiment N" (GenAI: traces, token usage).
    assert text.startswith(f"Runs - Experiment {experiment_id} ") and "Token Usage" not in text, text[-2000:]
    assert "sweep: parallelism=ddp,fsdp" in text and "3 matching runs" in text, text[-2000:]  # the runs table


def test_mlflow_ui_lists_the_sweep_in_headless_chromium(server_sweep):
    url, experiment_id = server_sweep
    runs_page = f"{url}/#/experiments/{experiment_id}/runs"
    text = _page_text(runs_page)
    assert "sweep: parallelism=ddp,fsdp" in text and "3 matching runs" in text, text[-2000:]
    [child] = _rest(
        url, "runs/search", {"experiment_ids": [experiment_id], "filter": "attributes.run_name = 'llama3_debug·fsdp2'"}
    )["runs"]
    assert "llama3_debug·fsdp2" in _page_text(f"{url}/#/experiments/{experiment_id}/runs/{child['info']['run_id']}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    screenshot = ARTIFACTS / "mlflow_ui_sweep_runs.png"
    screenshot.unlink(missing_ok=True)
    chromium(f"--screenshot={screenshot}", runs_page)
    assert screenshot.stat().st_size > 10_000  # a rendered page, not an empty canvas
    print(f"screenshot: {screenshot}")


def test_the_printed_link_opens_on_the_sweeps_points_sorted_by_tps(server_sweep):
    url, experiment_id = server_sweep
    port = url.rsplit(":", 1)[1]
    printed = subprocess.run(
        [sys.executable, "-m", "titan_exp", "ui", "--uri", url, "--port", port, "--print-link"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    link, charts = printed.stdout.split()
    assert link.startswith(f"{url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"), link
    text = _page_text(link)
    assert "Token Usage" not in text and "Model training" in text  # not the GenAI overview
    assert "Sort: throughput/tps_per_device_mean" in text and "2 matching runs" in text, text[-2000:]
    children = _rest(url, "runs/search", {"experiment_ids": [experiment_id], "filter": "tags.world_size = '2'"})["runs"]
    for child in children:
        metrics = {m["key"]: m["value"] for m in child["data"]["metrics"]}
        assert child["info"]["run_name"] in text
        assert str(metrics["throughput/tps_per_device_mean"])[:5] in text  # its TPS/device (JS prints floats as repr)
    # The same runs as MLflow's charts: the loss curves overlaid, TPS/device and MFU per run.
    assert charts == f"{link}&compareRunsMode=CHART"
    charts_text = _page_text(charts)
    # Its section holds the loss, TPS/device, MFU and CPU peak-memory charts (the CUDA one has no data here).
    assert "Strategy comparison (4)" in charts_text, charts_text[-2000:]
    screenshot = ARTIFACTS / "mlflow_ui_comparison_charts.png"
    screenshot.unlink(missing_ok=True)
    chromium("--window-size=1600,1000", f"--screenshot={screenshot}", charts)
    assert screenshot.stat().st_size > 10_000
    screenshot = ARTIFACTS / "mlflow_ui_comparison_link.png"
    screenshot.unlink(missing_ok=True)
    chromium("--window-size=1600,900", f"--screenshot={screenshot}", link)
    assert screenshot.stat().st_size > 10_000
    print(f"screenshot: {screenshot}")


def test_local_sweep_runs_its_points_side_by_side_and_compares_them_into_the_parent_run(tmp_path, store):
    uri, db = store
    # 2 points (1 and 2 ranks) on 2 cores: side by side only when oversubscribing is asked for.
    side_by_side = ["launcher.max_parallel=2", "launcher.oversubscribe=true", "training.steps=10"]
    system_metrics = ["tracking.system_metrics=true", "tracking.system_metrics_interval_s=1"]
    result = run_cli(
        [*SMOKE, uri, "parallelism=fsdp", *side_by_side, *system_metrics, "launcher.nproc_per_node=1,2"],
        tmp_path,
        flags=("-m",),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"^\[1\] launcher.nproc_per_node=2: done \(step 10, loss", result.stdout, re.M), result.stdout
    [parent] = mlflow_runs(db, sweeps=True)
    points = mlflow_runs(db)
    assert parent.info.status == "FINISHED"
    assert [p.data.tags["mlflow.parentRunId"] for p in points] == [parent.info.run_id] * 2
    assert any(key.startswith("system/cpu_utilization_percentage") for key in points[0].data.metrics), points[
        0
    ].data.metrics.keys()
    # Side by side: each started before the other ended, each confined to a core of its own.
    first, second = points
    assert first.info.status == second.info.status == "FINISHED"
    assert first.info.start_time < second.info.end_time and second.info.start_time < first.info.end_time
    cores = {run.data.params["derived/cpu_set"] for run in points}
    assert len(cores) == 2 and all(re.fullmatch(r"\d+", core) for core in cores)  # one core each, not the same
    assert {run.data.params["launcher.cpu_threads_per_rank"] for run in points} == {"1"}

    with open(tmp_path / "multirun" / "compare" / "strategy_table.csv") as file:
        rows = {row["world_size"]: row for row in csv.DictReader(file)}
    tps = {p.data.tags["world_size"]: p.data.metrics["throughput/tps_per_device_mean"] for p in points}
    assert float(rows["1"]["scaling_efficiency"]) == 1.0
    assert float(rows["2"]["scaling_efficiency"]) == pytest.approx(tps["2"] / tps["1"])
    assert float(rows["2"]["tps_per_device"]) == tps["2"] and rows["2"]["status"] == "FINISHED"
    artifacts = {a.path for a in mlflow_client(db).list_artifacts(parent.info.run_id, "compare")}
    assert {
        f"compare/{name}"
        for name in (
            "strategy_table.md",
            "strategy_table.csv",
            "strategy_table.html",
            "loss_curves.png",
            "throughput.png",
            "memory.png",
            "scaling.png",
        )
    } <= artifacts

    # A job started on its own joins the sweep by its parent run id; the command line compares all three.
    joined = run_cli(
        [*SMOKE, uri, "parallelism=ddp", "launcher.nproc_per_node=2", f"tracking.parent_run_id={parent.info.run_id}"],
        tmp_path / "joined",
    )
    assert joined.returncode == 0, joined.stderr[-3000:]
    out = tmp_path / "again"
    cli = subprocess.run(
        [sys.executable, "-m", "titan_exp.compare", "--uri", f"sqlite:///{db}", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    with open(out / "strategy_table.csv") as file:
        again = {row["strategy"]: row for row in csv.DictReader(file)}
    assert sorted(again) == ["llama3_debug·ddp2", "llama3_debug·fsdp2", "llama3_debug·single"]
    # What differs between the joined run and the sweep's is a column; ddp2 has no scaling of its own.
    assert [again[name]["parallelism.name"] for name in sorted(again)] == ["ddp", "fsdp", "fsdp"]
    assert again["llama3_debug·ddp2"]["scaling_efficiency"] == ""
    assert float(again["llama3_debug·fsdp2"]["scaling_efficiency"]) == float(rows["2"]["scaling_efficiency"])
    # Best first: the rows stand in falling TPS/device.
    tps_column = [float(row["tps_per_device"]) for row in again.values()]
    assert tps_column == sorted(tps_column, reverse=True)
    bad = subprocess.run(
        [sys.executable, "-m", "titan_exp", "compare", "--uri", f"sqlite:///{db}", "--sweep", "nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        bad.returncode == 2
        and bad.stderr.strip().splitlines() == [bad.stderr.strip()]
        and "--sweep=nope: no such run" in bad.stderr
    )


# As many jobs as a 2-core machine runs at once with room to spare for contention on the store.
JOBS_SHARING_A_STORE = 4


def test_four_jobs_writing_to_one_new_sqlite_store_lose_nothing(tmp_path, new_store):
    uri, db = new_store
    jobs = []
    for i in range(JOBS_SHARING_A_STORE):
        command = [
            sys.executable,
            "-m",
            "titan_exp",
            f"hydra.run.dir={tmp_path}/job{i}",
            *SMOKE,
            uri,
            "parallelism=single",
            "launcher.nproc_per_node=1",
            f"tracking.run_name=job{i}",
            f"debug.seed={i}",
        ]
        log = open(tmp_path / f"job{i}.log", "w")
        jobs.append(
            subprocess.Popen(
                command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT
            )
        )
    for i, job in enumerate(jobs):
        assert job.wait(timeout=600) == 0, (tmp_path / f"job{i}.log").read_text()[-3000:]
        assert "database is locked" not in (tmp_path / f"job{i}.log").read_text()  # retries that succeed are silent
    runs = mlflow_runs(db)
    assert sorted(r.info.run_name for r in runs) == [f"job{i}" for i in range(JOBS_SHARING_A_STORE)]
    client = mlflow_client(db)
    for run in runs:
        assert run.info.status == "FINISHED"
        assert len(run.data.metrics) >= 12
        for key in run.data.metrics:
            steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            expected = [1, 2, 3, 4, 5, 6] if not key.endswith("_mean") else [2, 3, 4, 5, 6]
            if key.startswith("startup/"):  # where the start-up went: once, at the first step
                expected = [1]
            assert steps == expected, (run.info.run_name, key, steps)

"""Tracking and comparison against real MLflow stores, on one tracked sweep (parent + child runs)
that every test here reads: its points side by side in a SQLite store, a `mlflow server` on
loopback over that store read back over REST, a job joining the sweep over HTTP, MLflow's UI in
headless Chromium, and the strategy table computed from what the runs logged."""

import csv
import html
import json
import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from launchers.rendezvous import free_port

from conftest import (
    REPO,
    SMALL_MODEL,
    chromium,
    mlflow_client,
    mlflow_runs,
    run_cli,
    start_mlflow_server,
    stop_mlflow_server,
    store_in,
    subcommand,
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


# The module's sweep: 2 points (1 and 2 ranks) on 2 cores, side by side (only when oversubscribing
# is asked for), recording the system's metrics too.
SWEEP = "launcher.nproc_per_node=1,2"
SIDE_BY_SIDE = ["launcher.max_parallel=2", "launcher.oversubscribe=true", "training.steps=10"]
SYSTEM_METRICS = ["tracking.system_metrics=true", "tracking.system_metrics_interval_s=1"]


@dataclass
class Tracked:
    db: Path  # the SQLite store
    folder: Path  # the sweep's folder (its points' and its comparison's)
    sweep: subprocess.CompletedProcess
    url: str  # the server's
    experiment_id: str
    parent_id: str  # the sweep's parent run
    joined_id: str  # the job that joined it over HTTP


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, migrated_store):
    """One tracked sweep, made as a user makes one and read by every test here: a local sweep into
    a SQLite store, `titan_exp ui` (a real `mlflow server`) on 127.0.0.1 over that store, and a job
    started on its own that joins the sweep by its parent run id, tracking over HTTP into the server."""
    root = tmp_path_factory.mktemp("tracked")
    uri, db = store_in(root, migrated_store)
    sweep = run_cli(
        [*SMOKE, uri, "parallelism=fsdp", *SIDE_BY_SIDE, *SYSTEM_METRICS, SWEEP], root / "sweep", flags=("-m",)
    )
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    [parent] = mlflow_runs(db, sweeps=True)
    port = free_port()
    server = start_mlflow_server(db, port, root / "server.log")
    try:
        url = f"http://127.0.0.1:{port}"
        joined = run_cli(
            [*SMOKE, f"tracking.uri={url}", "parallelism=ddp", "launcher.nproc_per_node=2"]
            + [f"tracking.parent_run_id={parent.info.run_id}"],
            root / "joined",
        )
        assert joined.returncode == 0, joined.stdout[-3000:] + joined.stderr[-3000:]
        experiment = _rest(url, "experiments/get-by-name?experiment_name=titan_exp")["experiment"]
        yield Tracked(
            db, root / "sweep" / "multirun", sweep, url, experiment["experiment_id"], parent.info.run_id,
            mlflow_runs(db)[-1].info.run_id,
        )  # fmt: skip
    finally:
        stop_mlflow_server(server)


def test_a_parent_run_the_server_does_not_have_is_refused(tracked):
    from titan_exp.config.compose import to_job_config
    from titan_exp.config.resolve import resolve
    from titan_exp.job.preflight import preflight
    from titan_exp.rules import ConfigError

    from conftest import compose_config

    def check(parent: str) -> None:
        uri = f"tracking.uri={tracked.url}"
        preflight(resolve(to_job_config(compose_config([uri, f"tracking.parent_run_id={parent}"]))))

    check(tracked.parent_id)
    with pytest.raises(ConfigError, match=f"no such run in {tracked.url}"):
        check("0123abcd")


def test_the_sweep_and_the_job_that_joined_it_over_http_read_back_through_the_rest_api(tracked):
    url = tracked.url
    runs = _rest(url, "runs/search", {"experiment_ids": [tracked.experiment_id]})["runs"]
    tags = {run["info"]["run_id"]: {t["key"]: t["value"] for t in run["data"].get("tags", [])} for run in runs}
    [parent] = [r for r in runs if tags[r["info"]["run_id"]].get("titan_exp.role") == "sweep"]
    children = [r for r in runs if r is not parent]
    parent_id = parent["info"]["run_id"]
    assert parent_id == tracked.parent_id
    assert parent["info"]["status"] == "FINISHED" and parent["info"]["run_name"] == f"sweep: {SWEEP}"
    assert "compare/strategy_table.html" in tags[parent_id]["mlflow.note.content"]  # its Overview says where
    experiment = _rest(url, f"experiments/get?experiment_id={tracked.experiment_id}")["experiment"]
    assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in experiment["tags"]
    names = sorted(r["info"]["run_name"] for r in children)
    assert names == ["llama3_debug·ddp2", "llama3_debug·fsdp2", "llama3_debug·single"]
    for child in children:
        child_id = child["info"]["run_id"]
        assert child["info"]["status"] == "FINISHED"
        assert tags[child_id]["mlflow.parentRunId"] == parent_id
        steps = int({p["key"]: p["value"] for p in child["data"]["params"]}["training.steps"])
        history = _rest(url, f"metrics/get-history?run_id={child_id}&metric_key=loss/global_avg")["metrics"]
        assert sorted(m["step"] for m in history) == list(range(1, steps + 1))
        # The joined job's log went up through the server, the points' into the store's folder.
        logs = _rest(url, f"artifacts/list?run_id={child_id}&path=logs")["files"]
        assert [f["path"] for f in logs] == ["logs/rank0.log"], child["info"]["run_name"]
    compare = {f["path"] for f in _rest(url, f"artifacts/list?run_id={parent_id}&path=compare")["files"]}
    # 1 and 2 ranks: a scaling to plot (where the points share a world size, none is: test_compare.py).
    assert {
        "compare/strategy_table.html",
        "compare/strategy_table.csv",
        "compare/loss_curves.png",
        "compare/scaling.png",
    } <= compare


def _page_text(url: str, *flags: str) -> str:
    """The text a reader sees on the page once its scripts have run (tags stripped, spaces collapsed)."""
    dom = chromium(*flags, "--dump-dom", url).stdout
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", dom)).split())


def _screenshot(name: str) -> Path:
    """Where Chromium leaves a screenshot for people to look at (none there yet)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / name).unlink(missing_ok=True)
    return ARTIFACTS / name


def test_mlflow_ui_in_a_new_browser_opens_the_experiment_on_the_sweeps_runs_not_genai(tracked, tmp_path):
    url, experiment_id = tracked.url, tracked.experiment_id
    screenshot = _screenshot("mlflow_ui_sweep_runs.png")
    # The experiment's own address, no workflowType in it, in a browser profile that has chosen
    # nothing: what it says and how it looks, in one load.
    new_profile = f"--user-data-dir={tmp_path / 'profile'}"
    text = _page_text(f"{url}/#/experiments/{experiment_id}", new_profile, f"--screenshot={screenshot}")
    # A plain `mlflow server` opens this address on "Overview - Experiment N" (GenAI: traces, token usage).
    assert text.startswith(f"Runs - Experiment {experiment_id} ") and "Token Usage" not in text, text[-2000:]
    assert f"sweep: {SWEEP}" in text and "4 matching runs" in text, text[-2000:]  # the runs table
    assert screenshot.stat().st_size > 10_000  # a rendered page, not an empty canvas
    [child] = _rest(
        url, "runs/search", {"experiment_ids": [experiment_id], "filter": "attributes.run_name = 'llama3_debug·fsdp2'"}
    )["runs"]
    assert "llama3_debug·fsdp2" in _page_text(f"{url}/#/experiments/{experiment_id}/runs/{child['info']['run_id']}")
    print(f"screenshot: {screenshot}")


def test_the_printed_link_opens_on_the_sweeps_points_sorted_by_tps(tracked):
    url, experiment_id = tracked.url, tracked.experiment_id
    port = url.rsplit(":", 1)[1]
    printed = subprocess.run(
        [sys.executable, "-m", "titan_exp", "ui", "--uri", url, "--port", port, "--print-link"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    link, charts = printed.stdout.split()
    assert link.startswith(f"{url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"), link
    link_shot = _screenshot("mlflow_ui_comparison_link.png")
    text = _page_text(link, "--window-size=1600,900", f"--screenshot={link_shot}")
    assert "Token Usage" not in text and "Model training" in text  # not the GenAI overview
    assert "Sort: throughput/tps_per_device_mean" in text and "3 matching runs" in text, text[-2000:]
    assert link_shot.stat().st_size > 10_000
    points = {"experiment_ids": [experiment_id], "filter": f"tags.`mlflow.parentRunId` = '{tracked.parent_id}'"}
    children = _rest(url, "runs/search", points)["runs"]
    assert len(children) == 3
    for child in children:
        metrics = {m["key"]: m["value"] for m in child["data"]["metrics"]}
        assert child["info"]["run_name"] in text
        assert str(metrics["throughput/tps_per_device_mean"])[:5] in text  # its TPS/device (JS prints floats as repr)
    # The same runs as MLflow's charts: the loss curves overlaid, TPS/device and MFU per run.
    assert charts == f"{link}&compareRunsMode=CHART"
    charts_shot = _screenshot("mlflow_ui_comparison_charts.png")
    charts_text = _page_text(charts, "--window-size=1600,1000", f"--screenshot={charts_shot}")
    # Its section holds the loss, TPS/device (steady and per interval), MFU and CPU peak-memory charts
    # (the CUDA one has no data here).
    assert "Strategy comparison (5)" in charts_text, charts_text[-2000:]
    assert charts_shot.stat().st_size > 10_000
    print(f"screenshots: {link_shot}, {charts_shot}")


def test_local_sweep_runs_its_points_side_by_side_and_compares_them_into_the_parent_run(tracked, tmp_path):
    db, result = tracked.db, tracked.sweep
    assert re.search(r"^\[1\] launcher.nproc_per_node=2: done \(step 10, loss", result.stdout, re.M), result.stdout
    [parent] = mlflow_runs(db, sweeps=True)
    *points, joined = mlflow_runs(db)
    assert parent.info.status == "FINISHED" and joined.info.run_id == tracked.joined_id
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
    # The same work a step at both sizes (job/held_batch.py): the 2-rank point halves its local batch.
    params = [run.data.params for run in points]
    assert len({p["derived/global_batch_tokens"] for p in params}) == 1
    batches = sorted((p["parallelism.data_parallel_shard_degree"], p["training.local_batch_size"]) for p in params)
    assert batches == [("1", "2"), ("2", "1")]  # (dp, local batch): either point may have started first
    # Two jobs writing to one store at once lose nothing: every step of every metric (the
    # throughput means from the second step, where the start-up went once at the first), and no
    # word of retries that succeeded.
    client = mlflow_client(db)
    for run in points:
        assert len(run.data.metrics) >= 12
        for key in (key for key in run.data.metrics if not key.startswith("system/")):
            steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            expected = [1] if key.startswith("startup/") else list(range(2 if key.endswith("_mean") else 1, 11))
            assert steps == expected, (run.info.run_name, key, steps)
    said = [log.read_text() for log in tracked.folder.rglob("*.log")]
    assert said and not [text for text in said if "database is locked" in text]

    with open(tracked.folder / "compare" / "strategy_table.csv") as file:
        rows = {row["world_size"]: row for row in csv.DictReader(file)}
    tps = {p.data.tags["world_size"]: p.data.metrics["throughput/tps_per_device_mean"] for p in points}
    assert float(rows["1"]["scaling_efficiency"]) == 1.0
    assert float(rows["2"]["scaling_efficiency"]) == pytest.approx(tps["2"] / tps["1"])
    assert float(rows["2"]["tps_per_device"]) == tps["2"] and rows["2"]["status"] == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "compare")}
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

    # The job started on its own joined the sweep by its parent run id; the command line compares all three.
    assert joined.data.tags["mlflow.parentRunId"] == parent.info.run_id
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


# Beyond the default suite, which holds a new store opened by processes at once (test_store.py)
# and two jobs writing into one store side by side (the sweep above).
@pytest.mark.slow
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


def test_plan_calibrate_refuses_what_it_cannot_use_in_one_line(tracked):
    """`titan_exp plan calibrate` on the sweep's store, refused in one line before it measures
    anything: another profile's runs, a failed run, too few runs. (A fit and the profile it writes:
    test_plan_calibrate.py, marked slow: it measures each run's compute.)"""
    uri = f"sqlite:///{tracked.db}"
    runs = mlflow_runs(tracked.db)
    some_run = runs[0].info.run_id
    refusals = {
        ("--hardware", "h100"): "0 finished run(s) with a measured TPS to fit on",
        ("--hardware", "h100", "--runs", some_run): f"run {some_run}: it ran with hardware=cpu, not h100",
        ("--hardware", "cpu", "--runs", f"{some_run},{runs[1].info.run_id}"): "2 finished run(s)",
        ("--hardware", "cpu", "--name", "h100"): "--name=h100: a profile shipped with titan_exp has that name",
    }
    client = mlflow_client(tracked.db)
    failed = client.create_run(tracked.experiment_id, run_name="a run that failed")
    try:
        client.log_param(failed.info.run_id, "hardware.name", "cpu")
        client.set_terminated(failed.info.run_id, "FAILED")
        refusals[("--hardware", "cpu", "--runs", failed.info.run_id)] = f"run {failed.info.run_id}: it ended FAILED"
        for args, said in refusals.items():
            refused = subcommand(["plan", "calibrate", *args, "--uri", uri])
            assert refused.returncode == 2 and said in refused.stderr, refused.stderr[-2000:]
            assert len(refused.stderr.strip().splitlines()) == 1
    finally:
        client.delete_run(failed.info.run_id)  # the other tests read the sweep's runs


def test_a_run_id_beside_a_checkpoint_reattaches_only_the_unfinished_run_of_that_folder_and_model(store):
    """A run-id file can be copied or crafted: the run it names goes on only if it carries the tag of
    the token beside the id (the run's writer put both there), did not finish, and logged the same
    checkpoint folder and model."""
    from titan_exp.tracking.run import owner_tag, why_not_go_on_in

    _, db = store
    uri = f"sqlite:///{db}"
    client = mlflow_client(db)
    experiment = client.create_experiment("titan_exp")
    mine = {"checkpoint.folder": "/ck", "model.dim": "64"}

    def run(params: dict[str, str], finished: bool) -> str:
        made = client.create_run(experiment, tags={owner_tag("token"): "1"}).info.run_id
        for key, value in params.items():
            client.log_param(made, key, value)
        client.set_terminated(made, "FINISHED" if finished else "FAILED")
        return made

    assert why_not_go_on_in(uri, run(mine, finished=False), "token", mine) is None
    for crafted in ("another token", None):
        unfinished = run(mine, finished=False)
        said = why_not_go_on_in(uri, unfinished, crafted, mine)
        assert said == f"run {unfinished} carries no tag of the token beside its id (a copied or crafted run-id file)"
    done = run(mine, finished=True)
    assert why_not_go_on_in(uri, done, "token", mine) == f"run {done} finished; its record stays as it is"
    other = run({**mine, "checkpoint.folder": "/elsewhere"}, finished=False)
    said = why_not_go_on_in(uri, other, "token", mine)
    assert said == f"run {other} logged checkpoint.folder=/elsewhere, this job has /ck"
    assert why_not_go_on_in(uri, "0" * 32, "token", mine) == f"the store has no run {'0' * 32}"

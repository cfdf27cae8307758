"""`titan_exp ui`: it refuses a port it cannot listen on, in one line, before any server starts; it
prints its links only once the server answers them, the comparison's columns whole in headless
Chromium; and it leaves no server process behind, whether stopped by Ctrl-C or when the server ends
before it answers (the UI of a real sweep is checked in test_tracking.py)."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from launchers.rendezvous import free_port
from titan_exp.compare.runs import MEMORY_KEYS
from titan_exp.compare.ui_view import STRATEGY_COLUMNS
from titan_exp.metric_names import LOSS, MFU_MEAN, TPS_MEAN
from titan_exp.tracking.run import PARENT_TAG, ROLE_TAG

from conftest import REPO, chromium, mlflow_client, process_group_alive, start_as_in_a_terminal, stopped_for_good


def _ui(db: Path, port: int, **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "titan_exp", "ui", "--uri", f"sqlite:///{db}", "--port", str(port)]
    return start_as_in_a_terminal(command, **popen)


def _server_of(ui: subprocess.Popen) -> int:
    """The pid of the server `ui` started (its only child; the leader of a session of its own), once
    it leads its group: between fork and setsid the child is still in the UI's, and a signal to its
    group would find none."""
    deadline = time.monotonic() + 60
    while True:
        children = Path(f"/proc/{ui.pid}/task/{ui.pid}/children").read_text().split()
        if children and os.getpgid(int(children[0])) == int(children[0]):
            return int(children[0])
        assert time.monotonic() < deadline and ui.poll() is None, "the UI started no server"
        time.sleep(0.02)


def test_busy_port_is_refused_in_one_line_and_starts_nothing(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        command = [
            sys.executable,
            "-m",
            "titan_exp",
            "ui",
            "--port",
            str(port),
            "--uri",
            f"sqlite:///{tmp_path}/mlflow.db",
        ]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, start_new_session=True)
    assert result.returncode == 2
    said = f"titan_exp ui: --port={port}: 127.0.0.1:{port} cannot be listened on (Address already in use)"
    assert result.stderr.strip().splitlines() == [f"{said}; pick another port"]
    assert time.monotonic() - start < 20 and not (tmp_path / "mlflow.db").exists()


def _sweep(db: Path) -> None:
    """A sweep as `compare` finds one: a parent run and two points with the strategy tags, metrics and
    batch params."""
    store = mlflow_client(db)
    experiment = store.create_experiment("titan_exp")
    parent = store.create_run(experiment, run_name="sweep: parallelism=ddp,fsdp", tags={ROLE_TAG: "sweep"})
    for i, (layout, mesh) in enumerate([("ddp2", "dp_replicate2"), ("fsdp2·tp2", "dp_shard2·tp2")]):
        tags = {PARENT_TAG: parent.info.run_id, "layout": layout, "world_size": "2", "mesh": mesh, "status": "finished"}
        run = store.create_run(experiment, run_name=f"llama3_debug·{layout}", tags=tags)
        metrics = {TPS_MEAN: 1523.456789012 + i, MFU_MEAN: 0.0123456789123, LOSS: 9.170979189}
        metrics |= {key: 0.4567891234 for key, _ in MEMORY_KEYS}
        for key, value in metrics.items():
            store.log_metric(run.info.run_id, key, value)
        batch = {"training.global_batch_size": 8, "derived/global_batch_tokens": 2048}
        for key, value in (batch | {"derived/gradient_accumulation_steps": 1 + i}).items():
            store.log_param(run.info.run_id, key, value)
        store.set_terminated(run.info.run_id)


def _columns(link: str) -> dict[str, int]:
    """The runs table's columns as Chromium lays `link` out (wide enough to lay out every one): the
    width of each, in the order they stand."""
    dom = chromium("--window-size=4000,900", "--dump-dom", link).stdout
    cells = re.findall(r'col-id="([^"]+)"[^>]*style="left: (\d+)px; width: (\d+)px;"', dom)
    return {column: int(width) for column, _, width in sorted(cells, key=lambda cell: int(cell[1]))}


def test_links_are_printed_once_they_answer_open_on_whole_columns_and_ctrl_c_leaves_no_server(tmp_path, store):
    _, db = store
    _sweep(db)
    port = free_port()
    ui = _ui(db, port, stdout=subprocess.PIPE, stderr=open(tmp_path / "ui.log", "w"))
    with stopped_for_good(ui, lambda ui: os.killpg(ui.pid, signal.SIGINT)):
        server = _server_of(ui)
        printed = []
        while not printed or not printed[-1].startswith("  as charts: "):
            line = ui.stdout.readline()
            assert line, f"the UI ended before its links: {(tmp_path / 'ui.log').read_text()[-3000:]}"
            for url in re.findall(r"http://\S+", line):  # fetched the moment it is read
                with urllib.request.urlopen(url, timeout=5) as page:
                    assert page.status == 200 and b"<head>" in page.read(), url
            printed.append(line)
        base = f"http://127.0.0.1:{port}"
        assert printed[0] == f"MLflow UI on {base} (Ctrl-C stops it)\n"
        link = printed[1].removeprefix("the latest comparison: ").strip()
        assert link.startswith(f"{base}/#/experiments/"), printed
        columns = _columns(link)
    # The strategy columns in their order, each as wide as its header and values need (13 px glyphs
    # of MLflow's font average under 6.5 px; the sort icon and padding take 30): MLflow's own 100 px
    # cut every metric key.
    assert [column for column in columns if column in STRATEGY_COLUMNS] == list(STRATEGY_COLUMNS), columns
    for column, longest in {"metrics.`throughput/tps_per_device_mean`": 30, "tags.`mesh`": 13}.items():
        assert columns[column] >= 6.5 * longest + 30, columns
    assert ui.returncode == 0 and not process_group_alive(server)


def test_a_server_that_ends_before_answering_is_said_in_one_line_and_leaves_nothing(tmp_path, store):
    _, db = store
    port = free_port()
    ui = _ui(db, port, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    server = None
    try:
        server = _server_of(ui)
        os.killpg(server, signal.SIGKILL)  # long before it answers: its start takes seconds
        out, err = ui.communicate(timeout=60)
        server_left = process_group_alive(server)  # what the UI left, before the cleanup below
    finally:  # whatever failed, nothing of the UI's left running (the server has a session of its own)
        for group in [ui.pid] if server is None else [server, ui.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
    assert ui.returncode == 1 and out == "", out
    said = f"the MLflow server ended (exit status -9) before it answered on http://127.0.0.1:{port}"
    assert err.strip().splitlines()[-1] == f"titan_exp ui: {said}; its output is above", err[-3000:]
    assert not server_left

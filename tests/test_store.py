"""A new SQLite store opened by several processes at the same moment (tracking/store.py's
create_store): every one of them gets a complete store. Plain MLflow clients racing the same way
fail in its migrations ("duplicate column name: step", "table ... already exists")."""

import subprocess
import sys
from pathlib import Path

from conftest import REPO, mlflow_client

# One client: it imports everything first, then for each store named on its stdin (the release)
# opens it and writes an experiment and a run into it.
_CLIENT = """
import sys
from titan_exp.tracking.store import client
import mlflow.tracking  # imported before the start: what races is the store's creation
print("ready", flush=True)
for uri in sys.stdin:
    store = client(uri.strip())
    run = store.create_run(store.create_experiment(sys.argv[1]))
    store.set_terminated(run.info.run_id)
    print(run.info.run_id, flush=True)
"""
CLIENTS, ROUNDS = 5, 3


def _race(clients: dict[str, subprocess.Popen], uri: str) -> dict[str, str]:
    """The clients released together onto `uri` (all are waiting on their stdin); each one's run id
    ("" from one that failed)."""
    for proc in clients.values():
        proc.stdin.write(uri + "\n")
        proc.stdin.flush()
    return {name: proc.stdout.readline().strip() for name, proc in clients.items()}


def test_processes_opening_a_new_store_at_once_all_get_a_complete_one(tmp_path):
    logs = {f"client{i}": tmp_path / f"client{i}.log" for i in range(CLIENTS)}
    clients = {
        name: subprocess.Popen(
            [sys.executable, "-c", _CLIENT, name],
            cwd=REPO,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
        )  # fmt: skip
        for name, log in logs.items()
    }
    try:
        for name, proc in clients.items():
            assert proc.stdout.readline() == "ready\n", logs[name].read_text()[-3000:]
        for round_ in range(ROUNDS):
            db = tmp_path / f"round{round_}" / "mlflow.db"
            runs = _race(clients, f"sqlite:///{db}")
            for name, run_id in runs.items():
                assert run_id, f"{name} failed on a new store: {logs[name].read_text()[-3000:]}"
            _assert_complete(db, runs)
    finally:
        for proc in clients.values():
            proc.kill()
            proc.wait()


def _assert_complete(db: Path, runs: dict[str, str]) -> None:
    """Each client's experiment and run in the store, and nothing beside it but its lock file."""
    store = mlflow_client(db)
    for name, run_id in runs.items():
        run = store.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert run.info.experiment_id == store.get_experiment_by_name(name).experiment_id
    assert sorted(e.name for e in store.search_experiments()) == ["Default", *sorted(runs)]
    assert sorted(p.name for p in db.parent.iterdir()) == ["mlflow.db", "mlflow.db.lock"]  # no draft left

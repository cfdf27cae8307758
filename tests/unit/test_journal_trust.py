"""A journal is data: a line the store would refuse, or one cut oddly, is named and skipped without
losing the rest; the job folder's run-id file is never written through a link; stores named in
messages keep their passwords to themselves (tracking/journal.py, sync.py, store.py). The crafted
journal of the probe itself (/etc/passwd, ../, links out, mlflow.* tags, another store) is in
test_unit_sync_trust.py."""

import json
from pathlib import Path

import pytest

from titan_exp import ui
from titan_exp.compare import cli as compare_cli
from titan_exp.tracking import sync
from titan_exp.tracking.journal import JOURNAL_FILE, RUN_ID_FILE, read
from titan_exp.tracking.store import client, server_answers

CREATE = ["create", {"run_name": "r", "tags": {"model": "m"}, "start_ms": 1}]


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    """One SQLite store for the module (creating one costs seconds), each test its own job and run."""
    return f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"


def _journal(job: Path, *lines: object, end: str = "\n") -> Path:
    job.mkdir(parents=True, exist_ok=True)
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    (job / JOURNAL_FILE).write_text(text + end)
    return job


def _metric(step: int, name: str, value: object, timestamp: int) -> list:
    return ["log_metrics", [[step, {name: value}, timestamp]]]


def test_values_the_store_would_refuse_are_named_and_the_rest_replayed(tmp_path, uri, capsys):
    job = _journal(
        tmp_path / "job",
        CREATE,
        _metric(1, "loss", 2.0, 1000),
        _metric(2, "../loss", 1.0, 1001),  # a name MLflow refuses: it would fail the whole batch
        _metric(2, "bad!", 1.0, 1001),
        _metric(2**64, "loss", 1.0, 1001),  # past SQLite's integers
        _metric(2, "loss", 1.0, -1),
        _metric(2, "loss", 10**400, 1001),  # an integer no double holds
        ["log_params", {"../lr": "1"}],
        ["log_params", {"lr": "0.003"}],
        ["log_text", "x", "."],
        ["log_text", "x", "notes/"],
        "[" * 100_000 + "]" * 100_000,  # JSON nested too deep for the parser
        _metric(3, "loss", 1.5, 1002),
        ["finish", "FINISHED", None, 2**64],
    )
    assert sync.main([str(job), "--uri", uri]) == 1
    said = capsys.readouterr().out
    assert {n for n in range(1, 15) if f"line {n}:" in said} == {3, 4, 5, 6, 7, 8, 10, 11, 12, 14}
    store = client(uri)
    run = store.get_run((job / RUN_ID_FILE).read_text())
    # Its only finish was refused, and no process writes the journal: the job is gone, the run KILLED.
    assert run.data.params == {"lr": "0.003"} and run.info.status == "KILLED"
    assert [(m.step, m.value) for m in store.get_metric_history(run.info.run_id, "loss")] == [(1, 2.0), (3, 1.5)]


def test_only_a_last_line_without_its_newline_passes_for_one_cut_short_by_a_kill(tmp_path):
    cut = _journal(tmp_path / "cut", CREATE, '["log_metrics", [[1, {"lo', end="")
    assert read(cut / JOURNAL_FILE).skipped == []
    whole = _journal(tmp_path / "whole", CREATE, '["log_metrics", [[1, {"lo')
    assert read(whole / JOURNAL_FILE).skipped == ["line 2: not JSON"]


def test_artifacts_a_folder_with_a_link_out_a_missing_file_and_a_clash_are_named_not_fatal(tmp_path, uri, capsys):
    job = tmp_path / "job"
    (job / "traces").mkdir(parents=True)
    (job / "traces" / "rank0.json").write_text("{}")
    (job / "traces" / "passwd").symlink_to("/etc/passwd")
    (job / "own").mkdir()
    (job / "own" / "a.txt").write_text("mine\n")
    _journal(
        job,
        CREATE,
        ["log_artifacts", str(job / "traces"), "profiling"],  # a link out inside the folder
        ["log_artifact", str(job / "gone.log"), "logs"],
        ["log_text", "a file", "own"],
        ["log_artifacts", "own", "own"],  # relative: the job folder's; "own" is a file in the run by now
        ["log_artifact", "own/a.txt", "kept"],
    )
    assert sync.main([str(job), "--uri", uri]) == 1
    said = capsys.readouterr().out
    assert "line 2: log_artifacts" in said and "from outside" in said
    assert "line 3: log_artifact" in said and "no such file" in said
    assert "line 5: log_artifacts: not written" in said and "line 6:" not in said
    store = client(uri)
    run_id = (job / RUN_ID_FILE).read_text()
    assert [a.path for a in store.list_artifacts(run_id, "kept")] == ["kept/a.txt"]
    assert store.list_artifacts(run_id, "profiling") == []


def test_the_run_id_file_is_never_written_or_read_through_a_link(tmp_path, uri, capsys):
    job = _journal(tmp_path / "job", CREATE, _metric(1, "loss", 2.0, 1000))
    (job / RUN_ID_FILE).symlink_to(tmp_path / "planted")  # dangling: following it would create the target
    assert sync.main([str(job), "--uri", uri]) == 1
    assert f"{job / RUN_ID_FILE} is a symbolic link" in capsys.readouterr().err
    assert not (tmp_path / "planted").exists()
    (job / RUN_ID_FILE).unlink()
    (job / RUN_ID_FILE).write_text("../../etc\n")
    assert sync.main([str(job), "--uri", uri]) == 1
    assert "holds no run id" in capsys.readouterr().err


def test_a_store_that_does_not_answer_is_named_without_its_password():
    said = server_answers("http://alice:s3cret@127.0.0.1:1", timeout_s=1.0)
    assert "http://alice:***@127.0.0.1:1/health" in said and "s3cret" not in said


@pytest.mark.parametrize("command", [ui.main, compare_cli.main])
def test_ui_and_compare_refuse_a_folder_for_a_store_in_one_line(tmp_path, capsys, command):
    assert command(["--uri", f"sqlite:///{tmp_path}"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and f"{tmp_path} is a folder, not a regular file" in said[0]

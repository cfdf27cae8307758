"""`sync` takes a job folder's journal as data, not instructions: crafted lines are named and skipped,
the rest replayed into the job's configured store (tracking/journal.py, tracking/sync.py)."""

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from titan_exp.tracking import sync
from titan_exp.tracking.store import client


@pytest.fixture
def job_folder(tmp_path: Path, store: tuple[str, Path]) -> tuple[Path, Path]:
    """A job folder as Hydra leaves it (its store, made: mlflow.db beside it), without a journal yet."""
    job, db = tmp_path / "job", store[1]
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save({"tracking": {"uri": f"sqlite:///{db}", "experiment": "titan_exp"}}, job / ".hydra" / "config.yaml")
    OmegaConf.save({"hydra": {"runtime": {"cwd": str(tmp_path)}}}, job / ".hydra" / "hydra.yaml")
    (job / "rank0.log").write_text("step 1\n")
    (tmp_path / "outside.txt").write_text("not the job's\n")
    (job / "link").symlink_to("/etc/passwd")
    return job, db


def test_a_crafted_journal_replays_only_the_jobs_own_records_into_the_jobs_store(tmp_path, job_folder, capsys):
    job, db = job_folder
    other = tmp_path / "other.db"
    created = {
        "uri": f"sqlite:///{other}", "experiment": "elsewhere", "parent_run_id": None, "run_name": "crafted",
        "tags": {"model": "llama3_debug", "mlflow.user": "spoofed", "mlflow.source.name": "spoofed"},
        "resume_run_id": None, "start_ms": 1,
    }  # fmt: skip
    lines = [
        json.dumps(["create", created]),
        json.dumps(["log_params", {"lr": "0.003"}]),
        json.dumps(["log_metrics", [[1, {"loss/global_avg": 2.0}, 1000]]]),
        "not json {",
        "5",
        json.dumps(["log_metrics", [[2, {"loss/global_avg": "abc"}, 1001]]]),
        json.dumps(["log_artifact", "/etc/passwd", "logs"]),
        json.dumps(["log_artifact", str(job / ".." / "outside.txt"), "logs"]),
        json.dumps(["log_artifact", str(job / "link"), "logs"]),
        json.dumps(["log_text", "escaped", "../../escape.txt"]),
        json.dumps(["log_artifact", str(job / "rank0.log"), "logs"]),
        json.dumps(["log_metrics", [[3, {"loss/global_avg": 1.5}, 1002]]]),
        json.dumps(["finish", "FINISHED", None, 2000]),
    ]
    (job / "tracking_journal.jsonl").write_text("\n".join(lines) + "\n")

    assert sync.main([str(job)]) == 1  # replayed, but not whole
    said = capsys.readouterr().out
    for number in (4, 5, 6, 7, 8, 9, 10):
        assert f"line {number}:" in said, said
    assert "line 11:" not in said and "line 12:" not in said

    assert not other.exists()  # the journal's own store is not written
    store = client(f"sqlite:///{db}")
    [run] = store.search_runs([store.get_experiment_by_name("titan_exp").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.003"}
    assert [(m.step, m.value) for m in store.get_metric_history(run.info.run_id, "loss/global_avg")] == [
        (1, 2.0),
        (3, 1.5),
    ]
    assert run.data.tags["model"] == "llama3_debug"
    assert "spoofed" not in run.data.tags.values()
    artifacts = {a.path for a in store.list_artifacts(run.info.run_id, "logs")}
    assert artifacts == {"logs/rank0.log"}
    assert not list(tmp_path.rglob("escape.txt"))


def test_without_its_config_a_journal_is_synced_only_into_a_store_given_by_hand(tmp_path, capsys):
    job = tmp_path / "job"
    job.mkdir()
    created = {"uri": f"sqlite:///{tmp_path}/named.db", "experiment": "titan_exp", "run_name": "r", "tags": {}}
    (job / "tracking_journal.jsonl").write_text(json.dumps(["create", created]) + "\n")
    assert sync.main([str(job)]) == 1
    assert "give one with --uri" in capsys.readouterr().err
    assert not (tmp_path / "named.db").exists()
    assert sync.main([str(job), "--uri", f"sqlite:///{tmp_path}/given.db"]) == 0
    assert (tmp_path / "given.db").exists() and not (tmp_path / "named.db").exists()


def _journal(job: Path, *lines: list, owner: str | None = "token-of-this-job") -> None:
    created = {"run_name": "r", "tags": {}, "start_ms": 1, **({"owner": owner} if owner else {})}
    (job / "tracking_journal.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in [["create", created], *lines])
    )


def test_a_crafted_folder_naming_another_run_writes_nothing_into_it(tmp_path, job_folder, capsys):
    """Issue 47 item 2: a real .hydra/, a journal whose run-id file names an unrelated FINISHED run,
    metrics and a `finish FAILED` line. The run claims no file of this folder: refused, the victim
    unchanged (whatever owner token the journal holds, or none)."""
    from titan_exp.tracking.config import TrackingConfig
    from titan_exp.tracking.run import MlflowRun

    job, db = job_folder
    victim = MlflowRun.create(TrackingConfig(uri=f"sqlite:///{db}"), "victim", {})
    victim.log_metrics([(1, {"loss/global_avg": 3.0}, 1000)])
    victim.finish("FINISHED")
    for owner in ("crafted-token", None):
        (job / "mlflow_run_id").write_text(victim.run_id)
        _journal(
            job,
            ["log_metrics", [[7, {"loss/global_avg": 9.0}, 5000]]],
            ["finish", "FAILED", "hijacked", 6000],
            owner=owner,
        )
        assert sync.main([str(job)]) == 1
        assert "was not written through this folder's tracking_journal.jsonl" in capsys.readouterr().err
    found = client(f"sqlite:///{db}").get_run(victim.run_id)
    assert found.info.status == "FINISHED" and "failure_reason" not in found.data.tags
    assert [m.step for m in client(f"sqlite:///{db}").get_metric_history(victim.run_id, "loss/global_avg")] == [1]


def test_sync_never_writes_into_an_ended_run_and_ends_one_whose_job_is_gone(tmp_path, job_folder, capsys):
    """The job's own run: once it has ended, a journal that goes on (a metric, a tag, a `finish
    FAILED`) adds nothing to it and changes nothing, and sync says what it left out (exit 1); a
    journal that stops without a word and that no process holds (its job killed outright mid-save)
    ends its run KILLED, with the reason; one still held by a living writer, or left open for a
    requeue, stays RUNNING."""
    from titan_exp.tracking.journal import GONE_REASON, Journal

    job, db = job_folder
    store = client(f"sqlite:///{db}")
    _journal(job, ["log_metrics", [[1, {"loss": 2.0}, 1000]]], ["finish", "FINISHED", None, 2000])
    assert sync.main([str(job)]) == 0
    run_id = (job / "mlflow_run_id").read_text()
    before = store.get_run(run_id)
    _journal(
        job,
        ["log_metrics", [[1, {"loss": 2.0}, 1000], [2, {"loss": 1.0}, 3000]]],
        ["log_params", {"late": "1"}],
        ["set_tag", "status", "hijacked"],
        ["finish", "FAILED", "late word", 4000],
    )
    assert sync.main([str(job)]) == 1
    said = capsys.readouterr().out
    assert f"run {run_id}: ended FINISHED before, left as it is (1 metric value(s) of the journal it lacks" in said
    found = store.get_run(run_id)
    assert found.info.status == "FINISHED" and found.info.end_time == before.info.end_time
    assert found.data.tags == before.data.tags and found.data.params == before.data.params
    assert [m.step for m in store.get_metric_history(run_id, "loss")] == [1]

    for name, last in (("held", None), ("requeued", ["leave_open", "requeued"]), ("gone", None)):
        folder = tmp_path / name
        shutil.copytree(job / ".hydra", folder / ".hydra")
        _journal(folder, ["log_metrics", [[1, {"loss": 2.0}, 1000]]], *([last] if last else []), owner=name)
        writer = Journal(folder / "tracking_journal.jsonl") if name == "held" else None
        assert sync.main([str(folder)]) == 0
        if writer:
            writer.close()
        found = store.get_run((folder / "mlflow_run_id").read_text())
        if name == "gone":
            assert found.info.status == "KILLED" and found.data.tags["failure_reason"] == GONE_REASON
            assert found.info.end_time == 1000  # as of its last metric
        else:
            assert found.info.status == "RUNNING", name


def test_a_copy_of_a_job_folder_writes_nothing_into_the_jobs_run(tmp_path, job_folder, capsys):
    """Issue 68 item 3: the run claims its journal file itself (its path and inode, run.claim), not
    a token the journal holds. A copy of the folder with a metric, a tag and a finish appended, a
    folder whose journal is a hard link to the job's, and one whose journal is a symbolic link to
    it are each refused in one line, and the run (still open: its job's writer holds the journal)
    is left as it was; the job's own folder still ends it once its job is gone."""
    from titan_exp.tracking.journal import GONE_REASON, Journal

    job, db = job_folder
    store = client(f"sqlite:///{db}")
    _journal(job, ["log_metrics", [[1, {"loss": 2.0}, 1000]]])
    writer = Journal(job / "tracking_journal.jsonl")  # the job still runs
    assert sync.main([str(job)]) == 0
    run_id = (job / "mlflow_run_id").read_text()
    before = store.get_run(run_id)
    crafted = [
        ["log_metrics", [[99, {"loss": 0.0001, "tps": 1e9}, 9000]]],
        ["set_tag", "status", "hijacked"],
        ["finish", "FINISHED", None, 9001],
    ]
    copy = tmp_path / "copy"
    shutil.copytree(job, copy, ignore=shutil.ignore_patterns("link"))
    with open(copy / "tracking_journal.jsonl", "a") as journal:
        journal.writelines(json.dumps(line) + "\n" for line in crafted)
    hard, soft = tmp_path / "hard", tmp_path / "soft"
    for folder in (hard, soft):
        shutil.copytree(job / ".hydra", folder / ".hydra")
        shutil.copy(job / "mlflow_run_id", folder / "mlflow_run_id")
    (hard / "tracking_journal.jsonl").hardlink_to(job / "tracking_journal.jsonl")
    (soft / "tracking_journal.jsonl").symlink_to(job / "tracking_journal.jsonl")
    for folder, why in ((copy, "was not written through"), (hard, "was not written through"), (soft, "not a regular")):
        assert sync.main([str(folder)]) == 1
        [line] = capsys.readouterr().err.strip().splitlines()
        assert why in line, line
    found = store.get_run(run_id)
    assert found.info.status == "RUNNING" and found.data.tags == before.data.tags
    assert [m.step for m in store.get_metric_history(run_id, "loss")] == [1]
    assert store.get_metric_history(run_id, "tps") == []

    writer.close()  # the job is gone: its own folder ends its run
    assert sync.main([str(job)]) == 0
    found = store.get_run(run_id)
    assert found.info.status == "KILLED" and found.data.tags["failure_reason"] == GONE_REASON


def test_a_journal_cannot_claim_a_run_or_forge_an_owner(tmp_path, job_folder, capsys):
    """A journal's tags (on `create` or `set_tag`) in the claim or owner namespaces are not set: a
    run's claims and owners come from the job, never from what a journal says."""
    from titan_exp.tracking.run import CLAIM_TAG_PREFIX, OWNER_TAG_PREFIX

    job, db = job_folder
    forged = {CLAIM_TAG_PREFIX + "0" * 32: "/elsewhere", OWNER_TAG_PREFIX + "1" * 32: "1"}
    created = {"run_name": "r", "tags": forged, "start_ms": 1}
    lines = [["create", created], *(["set_tag", key, value] for key, value in forged.items())]
    (job / "tracking_journal.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert sync.main([str(job)]) == 1
    said = capsys.readouterr().out
    assert "line 2: set_tag" in said and "line 3: set_tag" in said
    tags = client(f"sqlite:///{db}").get_run((job / "mlflow_run_id").read_text()).data.tags
    assert not forged.keys() & tags.keys()


def test_the_writer_claims_its_journal_and_a_run_that_lost_a_record_stays_open(tmp_path, job_folder, monkeypatch):
    """The real writer (tracking/writer.py): its run claims the journal the job writes (a copy of
    the folder is refused); a path given relative is journaled absolute (a sweep point's folder is
    relative to the sweep's working directory: issue 68, `sync` of a point found no rank0.log); a
    record the store refused (a file gone before the writer got to it) leaves the run open, so that
    `sync` can still write what the journal holds and end it as the job did."""
    from titan_exp.tracking.config import TrackingConfig
    from titan_exp.tracking.run import claim
    from titan_exp.tracking.writer import BackgroundTracker

    job, db = job_folder
    monkeypatch.chdir(tmp_path)
    journal = job / "tracking_journal.jsonl"
    tracker = BackgroundTracker(TrackingConfig(uri=f"sqlite:///{db}"), "r", {}, (job / "mlflow_run_id",), None, journal)
    tracker.log_metrics(1, {"loss": 2.0})
    tracker.log_artifact(Path("job/rank0.log"), "logs")
    tracker.log_artifact(Path("job/gone.log"), "logs")  # the store refuses it: no such file
    tracker.close("FINISHED")
    assert tracker.incomplete == "the writer failed"
    store = client(f"sqlite:///{db}")
    run_id = (job / "mlflow_run_id").read_text()
    found = store.get_run(run_id)
    assert claim(journal).items() <= found.data.tags.items() and found.info.status == "RUNNING"
    paths = [json.loads(line)[1] for line in journal.read_text().splitlines() if line.startswith('["log_artifact"')]
    assert paths == [str(job / "rank0.log"), str(job / "gone.log")]

    shutil.copytree(job, tmp_path / "copy", symlinks=True)
    assert sync.main([str(tmp_path / "copy")]) == 1
    assert store.get_run(run_id).info.status == "RUNNING"
    assert sync.main(["job"]) == 1  # relative, as a user types it; gone.log is named
    found = store.get_run(run_id)
    assert found.info.status == "FINISHED"
    assert [a.path for a in store.list_artifacts(run_id, "logs")] == ["logs/rank0.log"]


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(8)
)


@pytest.mark.parametrize(
    "case,said",
    [
        ("elsewhere", "no MLflow store at"),
        ("other_app", "another application's SQLite database"),
        ("billion_laughs", "uses YAML anchors or aliases"),
        ("python_tag", "is not YAML that can be read as plain data"),
        ("fifo", "is a FIFO, not a regular file"),
        ("huge", "bytes, more than the 1,048,576 such a file may be"),
    ],
)
def test_a_crafted_saved_config_makes_sync_create_or_touch_no_store(tmp_path, case, said, capsys):
    """Issue 68 item 3: sync reads the store from the folder's .hydra/config.yaml, which is data: it
    writes only into a store that exists and is MLflow's (never one made where the folder points,
    nor another application's database), and a config that is a FIFO, too large, a YAML "billion
    laughs" or a Python object is refused within a second, in one line."""
    import contextlib
    import os
    import sqlite3
    import time

    job = tmp_path / "job"
    (job / ".hydra").mkdir(parents=True)
    _journal(job, ["log_metrics", [[1, {"loss": 2.0}, 1000]]])
    config, target = job / ".hydra" / "config.yaml", tmp_path / "elsewhere" / "new.db"
    if case in ("elsewhere", "other_app"):
        if case == "other_app":
            target.parent.mkdir()
            with contextlib.closing(sqlite3.connect(target)) as other:
                other.execute("CREATE TABLE notes (text)")
                other.commit()
        OmegaConf.save({"tracking": {"uri": f"sqlite:///{target}"}}, config)
    elif case == "billion_laughs":
        config.write_text(BILLION_LAUGHS + f"tracking: {{uri: 'sqlite:///{target}'}}\n")
    elif case == "python_tag":
        config.write_text(f"tracking: !!python/object/apply:os.system ['touch {tmp_path}/ran']\n")
    elif case == "fifo":
        os.mkfifo(config)
    else:
        config.write_text(f"tracking: {{uri: 'sqlite:///{target}'}}\n# {'x' * (2 << 20)}\n")
    before = target.read_bytes() if target.exists() else None
    started = time.monotonic()
    assert sync.main([str(job)]) == 1
    assert time.monotonic() - started < 5
    [line] = capsys.readouterr().err.strip().splitlines()
    assert said in line, line
    assert (target.read_bytes() if target.exists() else None) == before
    assert not (tmp_path / "ran").exists() and not (job / "mlflow_run_id").exists()


def test_sync_ends_a_parent_run_its_sweep_left_open_once_its_points_have(tmp_path, store, capsys):
    """Issue 68, faults: a sweep's process SIGKILLed leaves its parent run RUNNING. While the sweep's
    process lives (it holds the parent-run file's lock), or a point's does (its journal's), sync
    leaves the parent open; once all are gone it ends it KILLED with the reason, as of its last
    point's end. A copy of the sweep's folder ends nothing."""
    from titan_exp.tracking.config import TrackingConfig
    from titan_exp.tracking.journal import Journal
    from titan_exp.tracking.parent_run import GONE_REASON, ParentRun

    sweep, db = tmp_path / "sweep", store[1]
    sweep.mkdir()
    # Hydra's record of the sweep: its store, relative to the folder it was launched from.
    OmegaConf.save({"hydra": {"runtime": {"cwd": str(tmp_path)}}, "tracking": {"uri": "sqlite:///mlflow.db"}},
                   sweep / "multirun.yaml")  # fmt: skip
    parent = ParentRun(TrackingConfig(uri=f"sqlite:///{db}"), "sweep: debug.seed=0,1", sweep, {})
    points = []
    for number, last in enumerate((["finish", "FINISHED", None, 2000], None)):
        point = sweep / str(number)
        (point / ".hydra").mkdir(parents=True)
        OmegaConf.save({"tracking": {"uri": f"sqlite:///{db}"}}, point / ".hydra" / "config.yaml")
        created = {"run_name": f"p{number}", "tags": {}, "start_ms": 1, "parent_run_id": parent.run_id}
        lines = [["create", created], ["log_metrics", [[1, {"loss": 2.0}, 1000 + number]]], *([last] if last else [])]
        (point / "tracking_journal.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        points.append(point)
    still_running = Journal(points[1] / "tracking_journal.jsonl")

    def parent_says() -> str:
        assert sync.main([str(sweep)]) == 0
        [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{sweep} into")]
        return line

    assert "left open, its sweep still runs" in parent_says()
    parent._file.close()  # the sweep's process is gone: the kernel lets its lock go
    assert "left open, a job of its sweep still runs" in parent_says()
    shutil.copytree(sweep, tmp_path / "copy")
    still_running.close()
    assert sync.main([str(tmp_path / "copy")]) == 1
    assert "was not opened through this folder's mlflow_parent_run_id" in capsys.readouterr().err
    assert client(f"sqlite:///{db}").get_run(parent.run_id).info.status == "RUNNING"

    assert "ended KILLED" in parent_says()
    found = client(f"sqlite:///{db}").get_run(parent.run_id)
    assert found.info.status == "KILLED" and found.data.tags["failure_reason"] == GONE_REASON
    assert found.info.end_time == 2000  # the last point's end: the first ended at 2000, the second as of 1001
    assert f"parent run {parent.run_id}: ended KILLED before, left as it is" in parent_says()

"""`sync` takes a job folder's journal as data, not instructions: crafted lines are named and skipped,
the rest replayed into the job's configured store (tracking/journal.py, tracking/sync.py)."""

import json
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from titan_exp.tracking import sync
from titan_exp.tracking.store import client


def _job_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A job folder as Hydra leaves it (its store: store.db beside it), without a journal yet."""
    job, db = tmp_path / "job", tmp_path / "store.db"
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save({"tracking": {"uri": f"sqlite:///{db}", "experiment": "titan_exp"}}, job / ".hydra" / "config.yaml")
    OmegaConf.save({"hydra": {"runtime": {"cwd": str(tmp_path)}}}, job / ".hydra" / "hydra.yaml")
    (job / "rank0.log").write_text("step 1\n")
    (tmp_path / "outside.txt").write_text("not the job's\n")
    (job / "link").symlink_to("/etc/passwd")
    return job, db


def test_a_crafted_journal_replays_only_the_jobs_own_records_into_the_jobs_store(tmp_path, capsys):
    job, db = _job_folder(tmp_path)
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


def test_a_crafted_folder_naming_another_run_writes_nothing_into_it(tmp_path, capsys):
    """Issue 47 item 2: a real .hydra/, a journal whose run-id file names an unrelated FINISHED run,
    metrics and a `finish FAILED` line. The run carries no tag of the journal's owner token: refused,
    the victim unchanged (with a token, or without one)."""
    from titan_exp.tracking.config import TrackingConfig
    from titan_exp.tracking.run import MlflowRun

    job, db = _job_folder(tmp_path)
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
        assert "was not written by this job folder" in capsys.readouterr().err
    found = client(f"sqlite:///{db}").get_run(victim.run_id)
    assert found.info.status == "FINISHED" and "failure_reason" not in found.data.tags
    assert [m.step for m in client(f"sqlite:///{db}").get_metric_history(victim.run_id, "loss/global_avg")] == [1]


def test_sync_never_changes_how_a_run_ended_and_ends_one_whose_job_is_gone(tmp_path, capsys):
    """The job's own run: a journal that says FAILED after the run ended FINISHED leaves it FINISHED
    (its metrics still go in); a journal that stops without a word and that no process holds (its
    job killed outright mid-save) ends its run KILLED, with the reason; one still held by a living
    writer, or left open for a requeue, stays RUNNING."""
    from titan_exp.tracking.journal import GONE_REASON, Journal

    job, db = _job_folder(tmp_path)
    store = client(f"sqlite:///{db}")
    _journal(job, ["log_metrics", [[1, {"loss": 2.0}, 1000]]], ["finish", "FINISHED", None, 2000])
    assert sync.main([str(job)]) == 0
    run_id = (job / "mlflow_run_id").read_text()
    _journal(job, ["log_metrics", [[2, {"loss": 1.0}, 3000]]], ["finish", "FAILED", "late word", 4000])
    assert sync.main([str(job)]) == 0
    assert "kept its end (FINISHED)" in capsys.readouterr().out
    found = store.get_run(run_id)
    assert found.info.status == "FINISHED" and [m.step for m in store.get_metric_history(run_id, "loss")] == [1, 2]

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

"""`sync` takes a job folder's journal as data, not instructions: crafted lines are named and skipped,
the rest replayed into the job's configured store (tracking/journal.py, tracking/sync.py)."""

import json
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

"""Checkpoints as a user meets them: a training checkpoint given as initial weights, a folder that
holds the last step already, and saves that are never taken for complete while they are written (a
newest checkpoint cut short: test_data_files.py's resume test)."""

from pathlib import Path

import pytest

from conftest import SMALL_MODEL, loss_curve, mlflow_runs, run_cli

RUN = [
    "data=synthetic",
    "training.seq_len=64",
    "training.local_batch_size=2",
    "metrics.log_freq=1",
    "launcher.device=cpu",
]
TWO_RANKS = ["parallelism=fsdp", "launcher.nproc_per_node=2"]


def periodic(folder: Path, steps: int) -> list[str]:
    return ["checkpoint=periodic", f"checkpoint.folder={folder}", "checkpoint.interval=5", f"training.steps={steps}"]


@pytest.mark.slow  # three 2-rank jobs; loading weights into a job runs by default in test_parity's seed checkpoint
def test_a_training_checkpoint_gives_its_weights_as_initial_load_path(tmp_path, store):
    uri, db = store
    trained = run_cli([*RUN, *TWO_RANKS, *periodic(tmp_path / "ckpt", 10), uri], tmp_path / "train")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-10", "step-5"]  # no .saving left
    fresh = run_cli([*RUN, *TWO_RANKS, "training.steps=2", uri], tmp_path / "fresh")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    load = f"checkpoint.initial_load_path={tmp_path}/ckpt/step-10"
    loaded = run_cli([*RUN, *TWO_RANKS, "training.steps=2", load, uri], tmp_path / "loaded")
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    _, fresh_run, loaded_run = mlflow_runs(db)
    # On the same first batch, trained weights (10 steps) score far better than initialized ones.
    assert loss_curve(db, fresh_run.info.run_id)[0] - loss_curve(db, loaded_run.info.run_id)[0] > 1.0


def test_a_tracked_run_names_itself_in_a_checkpoint_folder_that_does_not_exist_yet(tmp_path, store):
    """The MLflow writer names its run beside the checkpoints (for a resume) as soon as the run is
    created, before any save has made the folder: here a run that never saves (its learning rate
    blows the weights up at step 2, long before its one save at step 100)."""
    uri, db = store
    folder = tmp_path / "new" / "ckpt"
    saves = ["checkpoint=periodic", f"checkpoint.folder={folder}", "checkpoint.interval=100", "training.steps=100"]
    done = run_cli([*RUN, *SMALL_MODEL, "parallelism=single", "optimizer.lr=1e30", *saves, uri], tmp_path / "run")
    assert done.returncode == 1, done.stderr[-3000:]
    (run,) = mlflow_runs(db)
    assert run.info.status == "FAILED" and "NonFiniteTraining" in run.data.tags["failure_reason"]
    assert not list(folder.glob("step-*")) and (folder / "mlflow_run_id").read_text() == run.info.run_id


def test_a_folder_that_holds_the_last_step_already_is_refused(tmp_path):
    from titan_exp.checkpoint.layout import step_dir

    done = step_dir(str(tmp_path / "ckpt"), 5)  # as a finished 5-step run leaves it
    done.mkdir(parents=True)
    (done / ".metadata").write_bytes(b"")
    again = run_cli([*RUN, "parallelism=single", *periodic(tmp_path / "ckpt", 5), "tracking=none"], tmp_path / "again")
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"titan_exp: config error: training.steps=5: checkpoint.folder={tmp_path}/ckpt holds step-5 already, "
        "so nothing is left to train; raise training.steps or point checkpoint.folder elsewhere"
    ]


def test_a_save_cut_short_is_not_taken_for_a_checkpoint(tmp_path):
    from titan_exp.checkpoint.layout import complete_steps, saving_dir, step_dir

    for step, name in ((5, "step-5"), (10, "step-10.saving"), (15, "step-15")):
        folder = tmp_path / name
        folder.mkdir()
        if step != 15:  # step-15 has no .metadata: DCP never finished it
            (folder / ".metadata").write_bytes(b"")
    assert complete_steps(str(tmp_path)) == [5]
    assert saving_dir(str(tmp_path), 10).name == "step-10.saving" and step_dir(str(tmp_path), 10).name == "step-10"

"""Checkpoints as a user meets them: a training checkpoint given as initial weights, a folder that
holds the last step already, and saves that are never taken for complete while they are written (a
newest checkpoint cut short: test_data_files.py's resume test)."""

from pathlib import Path

import pytest

from titan_exp.optim.config import LRSchedulerConfig, lr_factor

from conftest import SMALL_MODEL, loss_curve, mlflow_client, mlflow_runs, run_cli, subcommand

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


def lrs(db: Path, run_id: str) -> dict[int, float]:
    from titan_exp.compare.runs import loss_curve as history

    return dict(history(mlflow_client(db), run_id, "lr"))


@pytest.mark.slow  # five one-rank jobs
def test_a_resume_checks_the_model_first_leaves_a_finished_run_as_it_is_and_follows_the_new_schedule(tmp_path, store):
    """Another model's job pointed at a checkpoint folder is refused before any rank starts, naming the
    key; the same model resuming with more steps goes on in a new run (the finished one keeps its
    record) at the LR an uninterrupted run of the new length has; by default each run keeps its
    checkpoints in its own folder."""
    uri, db = store
    one_rank = [*RUN, *SMALL_MODEL, "parallelism=single", "lr_scheduler.warmup_steps=2", uri]
    first = run_cli([*one_rank, *periodic(tmp_path / "ckpt", 10)], tmp_path / "first")
    assert first.returncode == 0, first.stderr[-3000:]
    (finished,) = mlflow_runs(db)
    history = lrs(db, finished.info.run_id)

    other = run_cli([*one_rank, *periodic(tmp_path / "ckpt", 15), "model.dim=32"], tmp_path / "other")
    assert other.returncode == 2
    assert other.stderr.strip().splitlines() == [
        f"titan_exp: config error: model.dim=32: the checkpoint in {tmp_path}/ckpt/step-10 has 64; "
        "train that model (model.dim=64) or point checkpoint.folder elsewhere"
    ]
    assert len(mlflow_runs(db)) == 1

    resumed = run_cli([*one_rank, *periodic(tmp_path / "ckpt", 15)], tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {tmp_path}/ckpt in a new MLflow run: run {finished.info.run_id} finished" in resumed.stdout
    whole = run_cli([*one_rank, "training.steps=15"], tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    before, after, uninterrupted = mlflow_runs(db)
    assert before.info.status == "FINISHED" and lrs(db, before.info.run_id) == history
    assert after.info.run_id != before.info.run_id and after.info.status == "FINISHED"
    went_on, straight = lrs(db, after.info.run_id), lrs(db, uninterrupted.info.run_id)
    assert sorted(went_on) == list(range(11, 16))
    assert all(abs(went_on[step] / straight[step] - 1) < 1e-6 for step in went_on), (went_on, straight)

    own = run_cli(
        [*RUN, *SMALL_MODEL, "parallelism=single", "checkpoint=periodic", "training.steps=2", uri], tmp_path / "own"
    )
    assert own.returncode == 0, own.stderr[-3000:]
    assert (tmp_path / "own" / "run" / "checkpoints" / "step-2" / "model.json").is_file()


@pytest.mark.slow  # two 2-rank jobs and a show: about 25 s (job/resume.py's rules: tests/unit/test_unit_resume.py)
def test_a_resume_goes_on_with_its_checkpoints_batch_and_records_what_it_changed_under_it(tmp_path, store):
    """Issue item 4: a job saved at 8 sequences a step (2 accumulated, as a sweep's held batch sets
    it), resumed with overrides that leave the global batch unset, trains the checkpoint's batch and
    says so, and says how 2 more steps change the LR schedule (the LRs its run logged). The unfinished
    run it goes on in keeps its first job's params; the lines and the value that changed
    (training.steps) are tags under the resume."""
    uri, db = store
    job = [*RUN, *SMALL_MODEL, *TWO_RANKS, "lr_scheduler.warmup_steps=2", uri]
    first = run_cli([*job, *periodic(tmp_path / "ckpt", 4), "training.global_batch_size=8"], tmp_path / "first")
    assert first.returncode == 0, first.stderr[-3000:]
    mlflow_client(db).set_terminated(mlflow_runs(db)[0].info.run_id, "KILLED")  # as a job stopped at step 4 leaves it
    again = [*job, *periodic(tmp_path / "ckpt", 6), "optimizer.lr=0.001"]
    shown = subcommand(["show", "--summary", *again])
    assert shown.returncode == 0, shown.stderr
    resumed = run_cli(again, tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (run,) = mlflow_runs(db)
    lr = lrs(db, run.info.run_id)
    # It trains at the LR it says: this job's peak (not the checkpoint's 3e-3) on its 6-step schedule.
    assert lr[5] == pytest.approx(1e-3 * lr_factor(4, 6, LRSchedulerConfig(warmup_steps=2)), rel=1e-6)
    said = [
        f"resume: trains 512 tokens a step as {tmp_path}/ckpt/step-4 did: global batch 8 = local batch 2 × 2 "
        "data-parallel ranks × accumulation 2 (by itself it would train 256; training.global_batch_size sets another)",
        f"resume: training.steps 4 → 6, optimizer.lr 0.003 → 0.001: the LR schedule changes: step 5 runs "
        f"{lr[5]:.2e} (step 4 ran {lr[4]:.2e} under the checkpoint's 4-step schedule)",
    ]
    assert [line for line in resumed.stdout.splitlines() if line.startswith("titan_exp: resume:")] == [
        f"titan_exp: {line}" for line in said
    ]
    # `show` said the same before the run, and showed the batch it trains.
    assert [line for line in shown.stdout.splitlines() if line.startswith("resume:")] == said
    assert "global batch    8 sequences = 2 × dp 2 × 2 microbatch(es)" in shown.stdout
    # The resumed job's first step trains the tokens the first job's first step did.
    tokens = {m.step: m.value for m in mlflow_client(db).get_metric_history(run.info.run_id, "tokens_seen")}
    assert tokens[5] == tokens[1] == 2 * 64 * 2  # a rank's: local batch × seq_len × accumulation
    assert run.data.params["training.steps"] == "4" and run.data.params["training.global_batch_size"] == "8"
    resume_tags = {key: value for key, value in run.data.tags.items() if key.startswith("resume/")}
    assert resume_tags == {
        "resume/step-4": "\n".join(said),
        "resume/step-4/training.steps": "6",
        "resume/step-4/optimizer.lr": "0.001",
    }

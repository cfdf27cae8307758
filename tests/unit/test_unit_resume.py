"""A resume as the launching process decides it, before any rank starts (job/resume.py), from a
checkpoint's record (checkpoint/model_record.py): the batch it goes on with and the lines it says.
End to end, with ranks and the MLflow run: tests/test_checkpoint.py."""

import dataclasses
import json
from pathlib import Path

import pytest

from titan_exp.checkpoint.hf_export import ExportSources
from titan_exp.checkpoint.layout import step_dir
from titan_exp.checkpoint.model_record import MODEL_FILE, TrainedAs, TrainingRecord, write_model_record
from titan_exp.config.compose import compose_job_config
from titan_exp.config.job import Resume
from titan_exp.job.resume import resolve_to_run
from titan_exp.optim.config import LRSchedulerConfig
from titan_exp.rules import ConfigError

# Two data-parallel ranks of local batch 2: a job that trains 4 sequences of 64 tokens a step by itself.
JOB = [
    "data=synthetic",
    "training.seq_len=64",
    "training.local_batch_size=2",
    "training.steps=10",
    "parallelism=fsdp",
    "launcher.nproc_per_node=2",
    "launcher.device=cpu",
    "tracking=none",
    "checkpoint=periodic",
]


def saved(folder: Path, trained_as: TrainedAs, step: int = 4) -> Path:
    """A complete step folder of `folder` whose record says its job trained as `trained_as`."""
    where = step_dir(str(folder), step)
    where.mkdir(parents=True)
    (where / ".metadata").write_bytes(b"")
    record = TrainingRecord(trained_as, ExportSources(None, None))
    write_model_record(where, compose_job_config(JOB).model, data_position=False, training=record)
    return where


def resumed(tmp_path: Path, *overrides: str):
    cfg = compose_job_config([*JOB, f"checkpoint.folder={tmp_path}/ckpt", *overrides])
    return resolve_to_run(cfg, tmp_path / "job")


def test_a_resume_trains_its_checkpoints_tokens_per_step_unless_the_global_batch_is_set(tmp_path):
    """Issue item 4: a sweep point trained at its held batch (8 sequences a step: accumulation 2), resumed
    with its own overrides, trained 4 without a word."""
    where = saved(tmp_path / "ckpt", TrainedAs(8 * 64, 10, 3e-3, LRSchedulerConfig()))
    job = resumed(tmp_path)
    t = job.config.training
    assert (t.local_batch_size, t.global_batch_size, job.accumulation) == (2, 8, 2)
    assert job.resume == Resume(
        4,
        (
            f"resume: trains 512 tokens a step as {where} did: global batch 8 = local batch 2 × 2 data-parallel "
            "ranks × accumulation 2 (by itself it would train 256; training.global_batch_size sets another)",
        ),
    )
    # Set by the user, under our name or torchtitan's, the batch is the user's: said where it differs.
    for given in ("training.global_batch_size=4", "training.num_tokens_per_train_step=256"):
        job = resumed(tmp_path, given)
        assert job.config.training.global_batch_size == 4 and job.accumulation == 1
        assert job.resume.lines == (
            f"resume: trains 256 tokens a step as training.global_batch_size=4 sets, where {where} trained 512",
        )
    # Tokens that are no whole sequences of this job's are refused, naming the key that chooses.
    with pytest.raises(
        ConfigError, match=r"^training.global_batch_size=-1: .* not whole sequences of training.seq_len=96"
    ):
        resumed(tmp_path, "training.seq_len=96")


def test_a_resume_with_the_checkpoints_batch_and_schedule_says_nothing(tmp_path):
    saved(tmp_path / "ckpt", TrainedAs(4 * 64, 10, 3e-3, LRSchedulerConfig()))
    job = resumed(tmp_path)
    assert job.config.training.global_batch_size == 4 and job.resume == Resume(4, ())


def test_a_resume_with_more_steps_says_how_the_lr_schedule_changes(tmp_path):
    """The issue's own figures: step 21 at 1.65e-03 where step 20 ran 3.00e-04 is right for a 40-step
    schedule (2 warmup steps), but nothing said it."""
    schedule = LRSchedulerConfig(warmup_steps=2)
    saved(tmp_path / "ckpt", TrainedAs(4 * 64, 20, 3e-3, schedule), step=20)
    job = resumed(tmp_path, "training.steps=40", "lr_scheduler.warmup_steps=2")
    assert job.resume.lines == (
        "resume: training.steps 20 → 40: the LR schedule changes: step 21 runs 1.65e-03 "
        "(step 20 ran 3.00e-04 under the checkpoint's 20-step schedule)",
    )
    job = resumed(tmp_path, "training.steps=40", "lr_scheduler.warmup_steps=4", "optimizer.lr=1e-3")
    assert job.resume.lines[0].startswith(
        "resume: training.steps 20 → 40, optimizer.lr 0.003 → 0.001, lr_scheduler.warmup_steps 2 → 4: "
    )


def test_a_record_that_says_its_training_in_other_terms_is_refused(tmp_path):
    """A checkpoint folder from someone else: its record decides a batch, so it is read as data."""
    where = saved(tmp_path / "ckpt", TrainedAs(4 * 64, 10, 3e-3, LRSchedulerConfig()))
    record = json.loads((where / MODEL_FILE).read_text())
    good = record["training"]
    assert good == dataclasses.asdict(TrainedAs(256, 10, 3e-3, LRSchedulerConfig()))
    for bad in (
        {**good, "tokens_per_step": "256"},
        {**good, "steps": True},
        {**good, "lr": -1.0},
        {**good, "lr_scheduler": {**good["lr_scheduler"], "decay_type": "exec"}},
        {**good, "lr_scheduler": ["cosine"]},
        {**good, "more": 1},
        [good],
    ):
        (where / MODEL_FILE).write_text(json.dumps({**record, "training": bad}))
        with pytest.raises(ConfigError, match=f"^checkpoint.folder={where}: its {MODEL_FILE} cannot be read"):
            resumed(tmp_path)

"""Names and folders a job writes under, refused before anything starts when they would be cut,
break a line or be shared: a run name MLflow cannot keep, a job folder with a line break (it reaches
logs, Slurm scripts and command lines), two sweep points checkpointing into one folder."""

from pathlib import Path

import pytest

from titan_exp.config.compose import compose_job_config
from titan_exp.config.resolve import resolve
from titan_exp.job.sweep_points import check_every_point, prepare_point
from titan_exp.rules import ConfigError
from titan_exp.tracking.config import MAX_RUN_NAME_CHARS

BASE = ["launcher.device=cpu", "launcher.nproc_per_node=1", "training.steps=4"]


def _composed(tmp_path: Path, *overrides: str):
    return compose_job_config([*BASE, f"tracking.uri=sqlite:///{tmp_path}/m.db", *overrides])


@pytest.mark.parametrize("length,refused", [(MAX_RUN_NAME_CHARS, False), (MAX_RUN_NAME_CHARS + 1, True), (9000, True)])
def test_a_run_name_longer_than_mlflow_keeps_is_refused(tmp_path, length, refused):
    cfg = _composed(tmp_path, f"tracking.run_name={'x' * length}")
    if not refused:
        assert resolve(cfg).config.tracking.run_name == "x" * length
        return
    with pytest.raises(ConfigError) as err:
        resolve(cfg)
    assert err.value.key == "tracking.run_name"
    assert f"is {length:,} characters; MLflow keeps {MAX_RUN_NAME_CHARS}" in str(err.value)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300  # one line, not the name


@pytest.mark.parametrize("name", ["a\nb", "a\rb", "a\x1b[2Jb"])
def test_a_job_folder_with_a_line_break_or_control_character_is_refused(tmp_path, name):
    with pytest.raises(ConfigError) as err:
        resolve(_composed(tmp_path), job_dir=tmp_path / name)
    assert err.value.key == "hydra.run.dir" and "must not hold a line break" in str(err.value)
    assert "\n" not in str(err.value)


def _points(tmp_path: Path, *per_point: list[str]):
    return [
        prepare_point(number, overrides, tmp_path / str(number), _composed(tmp_path, *overrides))
        for number, overrides in enumerate(per_point)
    ]


def test_sweep_points_checkpointing_into_one_folder_are_refused(tmp_path):
    shared = ["checkpoint.enable=true", f"checkpoint.folder={tmp_path}/ckpt"]
    points = _points(tmp_path, [*shared, "optimizer.lr=1e-3"], [*shared, "optimizer.lr=2e-3"])
    with pytest.raises(ConfigError) as err:
        check_every_point(points)
    assert err.value.key == "checkpoint.folder"
    assert "sweep points [0] and [1] would save and resume each other's steps there" in str(err.value)


@pytest.mark.parametrize(
    "per_point",
    [
        # Each point's own folder (the default), its own named folder, or no checkpoints at all.
        (["checkpoint.enable=true", "optimizer.lr=1e-3"], ["checkpoint.enable=true", "optimizer.lr=2e-3"]),
        (["checkpoint.enable=true", "checkpoint.folder=A"], ["checkpoint.enable=true", "checkpoint.folder=B"]),
        (["checkpoint.folder=SAME", "optimizer.lr=1e-3"], ["checkpoint.folder=SAME", "optimizer.lr=2e-3"]),
    ],
)
def test_sweep_points_with_folders_of_their_own_are_accepted(tmp_path, per_point):
    overrides = [[o.replace("=A", f"={tmp_path}/a").replace("=B", f"={tmp_path}/b").replace("SAME", str(tmp_path / "s"))
                  for o in point] for point in per_point]  # fmt: skip
    check_every_point(_points(tmp_path, *overrides))


@pytest.mark.parametrize(
    "override",
    [
        "tracking.run_name='red\x1b[31m'",  # ESC: a terminal escape sequence, printed with the run's name
        "tracking.run_name='red\x9b31m'",  # the 8-bit CSI, which some terminals take as ESC [
        "tracking.run_name='two\u2028lines'",
        "model.hf_path='FOLDER/red\x1b[31m'",  # the run is named after the folder
    ],
)
def test_names_that_would_command_the_terminal_are_refused(tmp_path, override):
    cfg = _composed(tmp_path, *(["model=hf"] if override.startswith("model.") else []),
                    override.replace("FOLDER", str(tmp_path)))  # fmt: skip
    with pytest.raises(ConfigError) as err:
        resolve(cfg)
    assert err.value.key == override.split("=")[0] and "control character" in str(err.value)
    assert "\x1b" not in str(err.value) and "\x9b" not in str(err.value)  # said as repr

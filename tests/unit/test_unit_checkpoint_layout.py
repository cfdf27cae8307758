"""titan_exp/checkpoint/layout.py on a made-up folder tree: which step-N folders count as complete
checkpoints (DCP's .metadata inside; 'step-N.saving' and other names never), and the newest one."""

from pathlib import Path

from titan_exp.checkpoint.layout import complete_steps, latest_step, saving_dir, step_dir


def checkpoint(folder: Path, name: str, *, complete: bool = True) -> None:
    (folder / name).mkdir(parents=True)
    if complete:
        (folder / name / ".metadata").write_bytes(b"")


def test_paths() -> None:
    assert step_dir("ckpt", 12) == Path("ckpt/step-12")
    assert saving_dir("ckpt", 12) == Path("ckpt/step-12.saving")


def test_no_folder_or_empty_folder_has_no_checkpoint(tmp_path: Path) -> None:
    assert latest_step(str(tmp_path / "missing")) is None
    assert latest_step(str(tmp_path)) is None and complete_steps(str(tmp_path)) == []


def test_steps_sort_numerically(tmp_path: Path) -> None:
    """step-10 is newer than step-9 (not a string order)."""
    for step in (9, 100, 10, 2):
        checkpoint(tmp_path, f"step-{step}")
    assert complete_steps(str(tmp_path)) == [2, 9, 10, 100]
    assert latest_step(str(tmp_path)) == 100


def test_a_save_in_progress_or_cut_short_is_ignored(tmp_path: Path) -> None:
    """A .saving folder (even with its .metadata written) and a step-N folder without .metadata."""
    checkpoint(tmp_path, "step-5")
    checkpoint(tmp_path, "step-10.saving")
    checkpoint(tmp_path, "step-20", complete=False)
    assert complete_steps(str(tmp_path)) == [5]
    assert latest_step(str(tmp_path)) == 5


def test_other_names_are_ignored(tmp_path: Path) -> None:
    for name in ("step-abc", "step-7.bak", "xstep-8", "step--3", "step-"):
        checkpoint(tmp_path, name)
    (tmp_path / "step-30").write_text("a file, not a folder")
    checkpoint(tmp_path, "step-3")
    assert complete_steps(str(tmp_path)) == [3]


def test_step_dir_is_where_latest_step_looks(tmp_path: Path) -> None:
    checkpoint(tmp_path, step_dir("", 42).name)
    assert latest_step(str(tmp_path)) == 42 and step_dir(str(tmp_path), 42).is_dir()

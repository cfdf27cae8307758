"""How checkpoints lie in `checkpoint.folder`: one `step-N` folder per saved step, complete once
it is there (saved as `step-N.saving`, renamed when the save has ended; its Hugging Face export
written as `step-N.exporting` and moved in). Torch-free: the config checks read it."""

import os
import re
import shutil
from pathlib import Path

from titan_exp.checkpoint.staging import is_ours, own_file

_STEP_DIR = re.compile(r"^step-(\d+)$")
# What a step's folder is named while it is written (a folder so named is no complete checkpoint).
SAVING_SUFFIX = ".saving"
# Where the Hugging Face export of a complete step-N is written until it is moved into it.
EXPORTING_SUFFIX = ".exporting"
# DCP's index of a checkpoint's tensors, written last: a folder without it is no complete checkpoint.
DCP_METADATA = ".metadata"
# The files of a step a resume reads (DCP's shards: <rank>_<n>.distcp), beside .metadata and model.json.
DCP_SHARDS = "*.distcp"


def step_dir(folder: str, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def saving_dir(folder: str, step: int) -> Path:
    """Where step N is written until it is complete."""
    return Path(folder) / f"step-{step}{SAVING_SUFFIX}"


def exporting_dir(folder: str, step: int) -> Path:
    """Where the Hugging Face export of step N is written until it is moved into step-N."""
    return Path(folder) / f"step-{step}{EXPORTING_SUFFIX}"


def complete_steps(folder: str) -> list[int]:
    """The steps with a complete checkpoint (a step-N folder, not a link, with DCP's .metadata),
    oldest first."""
    steps = [
        int(m.group(1))
        for p in Path(folder).glob("step-*")
        if (m := _STEP_DIR.match(p.name)) and not p.is_symlink() and os.path.lexists(p / DCP_METADATA)
    ]
    return sorted(steps)


def check_folder(folder: str) -> None:
    """ValueError naming the first entry of `folder` that no save of this project left there: a
    step folder that is a link (a save would replace or prune it, a resume read through it), a
    `.saving`/`.exporting` folder without our mark (a save would write into it)."""
    for path in sorted(Path(folder).glob("step-*")):
        staged = path.name.endswith((SAVING_SUFFIX, EXPORTING_SUFFIX))
        if not _STEP_DIR.match(path.name.rsplit(".", 1)[0] if staged else path.name):
            continue
        if path.is_symlink():
            raise ValueError(f"{path} is a link to {os.readlink(path)}, not a folder a save wrote")
        if staged and not is_ours(path):
            raise ValueError(f"{path} is not a folder a save of this project left (no mark of ours)")


def check_step_files(step_folder: Path) -> None:
    """ValueError naming the first file a resume or a load would read in `step_folder` (.metadata,
    DCP's shards) that is no regular file or is a link (a FIFO blocks its reader for ever)."""
    for path in (step_folder / DCP_METADATA, *sorted(step_folder.glob(DCP_SHARDS))):
        own_file(path)


def run_id_beside(folder: str) -> Path:
    """Where rank 0's writer names the MLflow run that saves into `folder`: a job resumed from these
    checkpoints goes on writing it (rank/entry.py), so no step is counted in two runs."""
    return Path(folder) / "mlflow_run_id"


def latest_step(folder: str) -> int | None:
    steps = complete_steps(folder)
    return steps[-1] if steps else None


class NotEnoughSpaceError(OSError):
    """The disk cannot hold the checkpoint about to be saved."""


def check_free_space(folder: str, needed_bytes: int) -> None:
    """Raise NotEnoughSpaceError if the disk of `folder` (of its nearest existing parent: the folder
    may not exist before the first save) has fewer than `needed_bytes` free."""
    where = Path(folder).absolute()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < needed_bytes:
        raise NotEnoughSpaceError(
            f"checkpoint folder {folder} needs {_size(needed_bytes)} for a checkpoint but its disk has "
            f"{_size(free)} free; free some space or point checkpoint.folder elsewhere"
        )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def folder_bytes(folder: Path) -> int:
    """What the files under `folder` take (a saved step: what the next save will take again)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

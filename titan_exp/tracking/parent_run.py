"""A parent MLflow run over several training jobs (a sweep's points, a parity check's layouts).

Its id is left in a folder the jobs share, where each job finds it and makes its own run a child
(also a job that runs as a separate process or Slurm job on a shared file system). The process that
opened it holds that file's lock until it ends it: `sync` ends a parent run whose process is gone
(killed outright) once its jobs have ended (end_if_gone)."""

import contextlib
import dataclasses
import fcntl
import os
from pathlib import Path

from titan_exp.tracking.config import TrackingConfig
from titan_exp.tracking.journal import JOURNAL_FILE, is_held, read_run_id
from titan_exp.tracking.run import ENDED, ROLE_TAG, MlflowRun, claim
from titan_exp.tracking.store import ensure_store

PARENT_RUN_FILE = "mlflow_parent_run_id"
_MAX_RUN_NAME = 250
# Why `sync` ends a parent run that its process left open.
GONE_REASON = (
    "the sweep stopped without ending its parent run (its process was killed outright); ended by titan_exp sync"
)


class ParentRun:
    def __init__(self, tracking: TrackingConfig, name: str, folder: Path, params: dict[str, object]):
        self.uri = tracking.store.uri
        self.folder = folder
        tracking = dataclasses.replace(tracking, uri=self.uri)
        ensure_store(tracking)
        folder.mkdir(parents=True, exist_ok=True)
        # Made first, and held (locked) while this process lives: the run claims this very file.
        path = folder / PARENT_RUN_FILE
        self._file = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644), "w")
        with contextlib.suppress(OSError):  # held by another sweep in this folder: the id is ours all the same
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            tags = {ROLE_TAG: "sweep", "sweep_dir": str(folder), **claim(path)}
            self.run = MlflowRun.create(tracking, name[:_MAX_RUN_NAME], tags)
        except BaseException:
            self._file.close()
            path.unlink()
            raise
        try:
            self.run.log_params(params)
            self._file.write(self.run.run_id)
            self._file.flush()
        except Exception as err:
            self.end("FAILED", f"{type(err).__name__}: {err}")
            raise
        print(f"MLflow parent run {self.run.run_id} ({name}) for the jobs in {folder}", flush=True)

    @property
    def run_id(self) -> str:
        return self.run.run_id

    def end(self, status: str, reason: str | None) -> None:
        """End the run; its file's lock goes with it."""
        try:
            self.run.finish(status, reason)
        finally:
            self._file.close()


def parent_run_id_in(folder: Path) -> str | None:
    """The id a ParentRun left in `folder`, if any."""
    path = folder / PARENT_RUN_FILE
    return path.read_text().strip() if path.exists() else None


def end_if_gone(id_file: Path, uri: str) -> str:
    """End the parent run that `id_file` names KILLED (GONE_REASON, as of its last job's end) where
    its process is gone (no process holds the file's lock) and so are its jobs (no journal under
    its folder held, every child run ended); one line saying what was done. Only a run that claims
    this very file (run.claim: a copy of the folder has none) is touched, and an ended one is not."""
    claims = claim(id_file)  # first: a link or a FIFO is not read
    run_id = read_run_id(id_file)
    run = MlflowRun(uri, run_id)
    status, tags = run.status_and_tags()
    if not claims.keys() <= tags.keys():
        raise ValueError(
            f"parent run {run_id} was not opened through this folder's {PARENT_RUN_FILE} (a copy of the "
            "sweep's folder, or one moved since); sync the folder the sweep wrote"
        )
    if status in ENDED:
        return f"parent run {run_id}: ended {status} before, left as it is"
    if is_held(id_file):
        return f"parent run {run_id}: left open, its sweep still runs"
    journals = [path for path in id_file.parent.rglob(JOURNAL_FILE) if path.is_file() and not path.is_symlink()]
    children = run.children()
    if any(map(is_held, journals)) or any(child.info.status not in ENDED for child in children):
        return f"parent run {run_id}: left open, a job of its sweep still runs"
    end_ms = max((child.info.end_time for child in children if child.info.end_time), default=None)
    run.finish("KILLED", GONE_REASON, end_ms)
    return f"parent run {run_id}: ended KILLED ({GONE_REASON})"

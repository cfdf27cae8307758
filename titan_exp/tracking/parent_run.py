"""A parent MLflow run over several training jobs (a sweep's points, a parity check's layouts).

Its id is left in a folder the jobs share, where each job finds it and makes its own run a child
(also a job that runs as a separate process or Slurm job on a shared file system)."""

import dataclasses
from pathlib import Path

from titan_exp.tracking.config import TrackingConfig
from titan_exp.tracking.run import ROLE_TAG, MlflowRun
from titan_exp.tracking.store import ensure_store

PARENT_RUN_FILE = "mlflow_parent_run_id"
_MAX_RUN_NAME = 250


class ParentRun:
    def __init__(self, tracking: TrackingConfig, name: str, folder: Path, params: dict[str, object]):
        self.uri = tracking.store.uri
        self.folder = folder
        tracking = dataclasses.replace(tracking, uri=self.uri)
        ensure_store(tracking)
        self.run = MlflowRun.create(tracking, name[:_MAX_RUN_NAME], {ROLE_TAG: "sweep", "sweep_dir": str(folder)})
        try:
            self.run.log_params(params)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / PARENT_RUN_FILE).write_text(self.run.run_id)
        except Exception as err:
            self.run.finish("FAILED", f"{type(err).__name__}: {err}")
            raise
        print(f"MLflow parent run {self.run.run_id} ({name}) for the jobs in {folder}", flush=True)

    @property
    def run_id(self) -> str:
        return self.run.run_id


def parent_run_id_in(folder: Path) -> str | None:
    """The id a ParentRun left in `folder`, if any."""
    path = folder / PARENT_RUN_FILE
    return path.read_text().strip() if path.exists() else None

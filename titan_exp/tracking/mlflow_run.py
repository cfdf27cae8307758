"""One MLflow run per training job.

The process that owns the job (the launching process, or rank 0 under torchrun/srun) creates the
store, the experiment and the run, and ends it with its final status; rank 0 logs into it. No other
rank ever opens the store.
"""

import getpass
import os
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

from titan_exp.tracking.config import TrackingConfig

# MLflow's per-call limits for log_batch.
_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_LENGTH = 6000


def absolute_uri(uri: str) -> str:
    """sqlite:///relative.db → sqlite:////abs/relative.db, so ranks started elsewhere find the same file."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


def _artifact_root(uri: str, experiment: str) -> str | None:
    """For a SQLite store, artifacts go beside the database (MLflow would use ./mlruns of the cwd)."""
    if uri.startswith("sqlite:///"):
        return (Path(urlparse(uri).path).parent / "mlartifacts" / experiment).as_uri()
    return None  # a server decides


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


class MlflowRun:
    def __init__(self, cfg: TrackingConfig, run_id: str):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=cfg.uri)
        self.run_id = run_id
        self._pending: list = []

    @classmethod
    def create(cls, cfg: TrackingConfig, run_name: str, tags: dict[str, str]) -> "MlflowRun":
        from mlflow.tracking import MlflowClient

        if cfg.uri.startswith("sqlite:///"):
            Path(urlparse(cfg.uri).path).parent.mkdir(parents=True, exist_ok=True)
        client = MlflowClient(tracking_uri=cfg.uri)
        experiment = client.get_experiment_by_name(cfg.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment
            else client.create_experiment(cfg.experiment, artifact_location=_artifact_root(cfg.uri, cfg.experiment))
        )
        base_tags = {"hostname": socket.gethostname(), "user": getpass.getuser(), "git_commit": git_commit()}
        run = client.create_run(experiment_id, run_name=run_name, tags={**base_tags, **tags})
        return cls(cfg, run.info.run_id)

    def log_params(self, params: dict[str, object]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:_MAX_PARAM_LENGTH]) for k, v in params.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + _MAX_PARAMS_PER_BATCH])

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Queued and written by MLflow's background thread, so training does not wait on the store."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._pending.append(self.client.log_batch(self.run_id, metrics=batch, synchronous=False))

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)

    def flush(self) -> None:
        for operation in self._pending:
            operation.wait()
        self._pending.clear()

    def finish(self, status: str, reason: str | None = None) -> None:
        """status: FINISHED | FAILED | KILLED. Metrics queued before are written first."""
        self.flush()
        tags = {"status": status.lower()}
        if reason:
            tags["failure_reason"] = reason[:5000]
        self.set_tags(tags)
        self.client.set_terminated(self.run_id, status=status)

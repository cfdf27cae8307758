"""The `tracking` config group (MLflow)."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class TrackingConfig:
    enable: bool = True
    # An MLflow tracking URI: sqlite:///relative/or/absolute.db, or http(s):// for a server.
    uri: str = "sqlite:///outputs/mlflow.db"
    experiment: str = "titan_exp"
    # None: derived from the model and the layout, e.g. llama3_8b·fsdp8·tp2·float8.
    run_name: Optional[str] = None
    # Make this job's run a child of that run. A Hydra multirun sets it to the sweep's parent run;
    # set it yourself to group jobs started separately (e.g. one sbatch per point).
    parent_run_id: Optional[str] = None
    # Also record host CPU/memory/disk/network (and GPU, with pynvml) utilization from rank 0's
    # node, sampled every system_metrics_interval_s (MLflow's system metrics, under system/).
    system_metrics: bool = False
    system_metrics_interval_s: float = 10.0
    # How long the end of a job waits for the store to take what is still queued; past it the rest
    # stays in the job's journal (tracking_journal.jsonl) for `python -m titan_exp sync DIR`.
    close_timeout_s: float = 300.0

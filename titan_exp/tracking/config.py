"""The `tracking` config group (MLflow)."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class TrackingConfig:
    enable: bool = True
    # An MLflow tracking URI: sqlite:///relative/or/absolute.db, or http(s):// for a server.
    uri: str = "sqlite:///outputs/mlflow.db"
    experiment: str = "titan_exp"
    # None: derived from the model and the layout, e.g. llama3_debug·fsdp2.
    run_name: Optional[str] = None
    # Set by the launching process after it created the run; ranks log into it. Not for users.
    run_id: Optional[str] = None

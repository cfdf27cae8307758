"""The `tracking` config group (MLflow), and the store its URI names."""

import urllib.parse
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Optional

from titan_exp.rules import ConfigError, Section, check_at_least, check_folder_name, check_one_line, check_positive

SQLITE_PREFIX = "sqlite:///"
# MLflow's runs.name column (String(250) in its SQL store; the UI cuts names there too).
MAX_RUN_NAME_CHARS = 250
STORE_FORMS = "sqlite:///path/to/mlflow.db or http(s)://host:port of an MLflow server (or tracking=none)"


@dataclass(frozen=True)
class Store:
    """An MLflow tracking URI, parsed once (the only parser of them): a SQLite file, made absolute so
    that ranks started elsewhere find the same file, or a tracking server."""

    uri: str
    # The SQLite database file; None for a server.
    db: Path | None

    @classmethod
    def parse(cls, uri: str) -> "Store":
        """Raises ValueError for a form titan_exp does not write to. sqlite:///rel.db is relative,
        sqlite:////abs.db absolute (not urlparse: it keeps '//abs.db', and file URIs made from it
        lose their first directory)."""
        if uri.startswith(SQLITE_PREFIX) and len(uri) > len(SQLITE_PREFIX):
            path = uri[len(SQLITE_PREFIX) :]
            if path == ":memory:" or "?" in path:  # SQLite's in-memory forms (mode=memory)
                raise ValueError("a database in memory keeps nothing once the job ends; name a file")
            db = Path(path).resolve()
            return cls(SQLITE_PREFIX + str(db), db)
        if uri.startswith(("http://", "https://")):
            return cls(uri, None)
        raise ValueError(f"unsupported store; use {STORE_FORMS}")

    @property
    def is_server(self) -> bool:
        return self.db is None

    def artifact_location(self, experiment: str) -> str | None:
        """Where a new experiment's artifacts go: beside a SQLite database (MLflow would use ./mlruns
        of the working directory), in a folder the name cannot lead out of; a server decides for itself."""
        check_folder_name("tracking.experiment", experiment)
        return (self.db.parent / "mlartifacts" / experiment).as_uri() if self.db else None


def masked(uri: str) -> str:
    """`uri` with the password of any user:password@ in it replaced by ***."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)))


@dataclass
class TrackingConfig(Section):
    enable: bool = True
    # The MLflow store: sqlite:///relative/or/absolute.db, or http(s):// for a server.
    uri: str = "sqlite:///outputs/mlflow.db"
    # The MLflow experiment the runs go to.
    experiment: str = "titan_exp"
    # None: derived from the model and the layout, e.g. <model>_8b·fsdp8·tp2·float8.
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

    @cached_property
    def store(self) -> Store:
        return Store.parse(self.uri)

    def check(self, key: str) -> None:
        if not self.enable:
            return
        if not self.experiment:
            raise ConfigError(f"{key}.experiment", "''", "must name an MLflow experiment, e.g. titan_exp")
        check_folder_name(f"{key}.experiment", self.experiment)  # its artifacts' folder in a SQLite store
        check_one_line(f"{key}.run_name", self.run_name)
        if self.run_name is not None and len(self.run_name) > MAX_RUN_NAME_CHARS:
            fix = f"is {len(self.run_name):,} characters; MLflow keeps {MAX_RUN_NAME_CHARS}: shorten it"
            raise ConfigError(f"{key}.run_name", f"{self.run_name[:40]}…", fix)
        check_positive(f"{key}.close_timeout_s", self.close_timeout_s)
        check_at_least(f"{key}.system_metrics_interval_s", self.system_metrics_interval_s, 1.0)
        if not self.uri:
            raise ConfigError(f"{key}.uri", "''", f"must name a store: {STORE_FORMS}")
        if urllib.parse.urlsplit(self.uri).password is not None:
            raise ConfigError(
                f"{key}.uri",
                masked(self.uri),
                "holds a password, which would be written to .hydra/ and the logs; give it in "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (MLflow reads them) instead",
            )
        try:
            Store.parse(self.uri)
        except ValueError as err:
            raise ConfigError(f"{key}.uri", self.uri, str(err)) from None

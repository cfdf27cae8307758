"""The job's context a rank receives beside the resolved job: where the job lives, who started it."""

from dataclasses import dataclass
from pathlib import Path

from titan_exp.metrics.startup import Marks
from titan_exp.tracking.journal import JOURNAL_FILE, RUN_ID_FILE, RUN_LOG_FILE


@dataclass(frozen=True)
class RunContext:
    """What the launching process tells the ranks besides the resolved job."""

    # The Hydra run directory: composed config, overrides, rank logs.
    job_dir: str
    # Who started the ranks: an engine (launchers/registry.py), torchrun or srun.
    started_by: str
    # The launching process's start-up so far, when it started the ranks on this machine (metrics/startup.py).
    startup: Marks = ()

    @property
    def run_id_file(self) -> Path:
        """Where rank 0 records its MLflow run id, so the launching process can close a dead job's run."""
        return Path(self.job_dir) / RUN_ID_FILE

    @property
    def journal_file(self) -> Path:
        """Rank 0's record of every call to the store, replayable (tracking/journal.py)."""
        return Path(self.job_dir) / JOURNAL_FILE

    @property
    def run_log_file(self) -> Path:
        """Rank 0's console output, logged with its MLflow run."""
        return Path(self.job_dir) / RUN_LOG_FILE

    def left_in_journal(self, why: str) -> str:
        return (
            f"the MLflow store did not take all of this run's records ({why}); they are kept in "
            f"{self.journal_file}: python -m titan_exp sync {self.job_dir} writes them in once the store is back"
        )

"""Rank 0's journal of its MLflow run: every call to the writer, appended to a JSON-lines file in the
job's folder before it is queued for the store. Whatever the store did not take (an outage that
outlasted the run, the writer or rank 0 killed) is replayed from it: by the launching process when
rank 0 died, and by `python -m titan_exp sync DIR` (tracking/sync.py). Replaying is idempotent:
metric values the run holds already (same key, step and timestamp) are skipped, params and
artifacts are written again with the same content."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from titan_exp.tracking.config import TrackingConfig
from titan_exp.tracking.run import MlflowRun, outcome
from titan_exp.tracking.store import server_answers

# In a job's folder: the journal, the id of the run it belongs to (written once the run exists),
# and rank 0's console, which goes into the run as logs/rank0.log.
JOURNAL_FILE = "tracking_journal.jsonl"
RUN_ID_FILE = "mlflow_run_id"
RUN_LOG_FILE = "rank0.log"


class Journal:
    """Appends one line per call and flushes it: a rank killed outright loses at most the line it
    was writing (the operating system holds what was flushed)."""

    def __init__(self, path: Path):
        self._file: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def record(self, call: str, *args: object) -> None:
        self._file.write(json.dumps([call, *args], default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read(path: Path) -> list[tuple[str, list]]:
    """The journal's calls in order; a last line cut short by a kill is left out."""
    calls = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            call, *args = json.loads(line)
        except (json.JSONDecodeError, ValueError):
            continue
        calls.append((call, args))
    return calls


@dataclass(frozen=True)
class Replayed:
    run_id: str
    metric_values_added: int
    metric_values_present: int
    ended: str | None  # the status the journal ended the run with, if it did and `end` was asked

    def describe(self) -> str:
        ended = f", ended {self.ended}" if self.ended else ""
        return (
            f"run {self.run_id}: {self.metric_values_added} metric value(s) added, "
            f"{self.metric_values_present} already there{ended}"
        )


def replay(journal: Path, uri: str | None = None, end: bool = True) -> Replayed:
    """Write what `journal` records into its run (in `uri`, by default the store it was written
    for), creating the run if it never reached the store; `end`: also end it as the journal did."""
    calls = read(journal)
    created = next((args[0] for call, args in reversed(calls) if call == "create"), None)
    if created is None:
        raise ValueError(f"{journal} records no run (no 'create' line)")
    cfg = TrackingConfig(
        uri=uri or created["uri"], experiment=created["experiment"], parent_run_id=created["parent_run_id"]
    )
    run = _open_run(journal.parent / RUN_ID_FILE, cfg, created["run_name"], created["tags"], created.get("start_ms"))
    params = {k: v for call, args in calls if call == "log_params" for k, v in args[0].items()}
    if params:
        run.log_params(params)
    records = [tuple(record) for call, args in calls if call == "log_metrics" for record in args[0]]
    missing = _missing_metric_values(run, records)
    if missing:
        run.log_metrics(missing)
    for call, args in calls:
        if call == "log_text":
            run.log_text(*args)
        elif call == "log_artifact" and Path(args[0]).exists():
            run.log_artifact(Path(args[0]), args[1])
        elif call == "log_artifacts" and Path(args[0]).is_dir():
            run.log_artifacts(Path(args[0]), args[1])
    finish = next((args for call, args in reversed(calls) if call == "finish"), None) if end else None
    if finish:
        run.finish(*finish)
    added = sum(len(metrics) for _, metrics, _ in missing)
    total = sum(len(metrics) for _, metrics, _ in records)
    return Replayed(run.run_id, added, total - added, finish[0] if finish else None)


def _open_run(
    run_id_file: Path, cfg: TrackingConfig, run_name: str, tags: dict[str, str], start_ms: int | None = None
) -> MlflowRun:
    """The run `run_id_file` names, or a new one (its id then written there)."""
    if run_id_file.exists():
        return MlflowRun(cfg.uri, run_id_file.read_text().strip())
    run = MlflowRun.create(cfg, run_name, tags, start_ms)
    run_id_file.write_text(run.run_id)
    return run


def _missing_metric_values(run: MlflowRun, records: list[tuple]) -> list[tuple[int, dict[str, float], int]]:
    """The journal's metric records less the values the run holds already (key, step, timestamp)."""
    keys = {key for _, metrics, _ in records for key in metrics}
    present = {(m.key, m.step, m.timestamp) for key in keys for m in run.metric_history(key)}
    missing = []
    for step, metrics, timestamp in records:
        left = {k: v for k, v in metrics.items() if (k, step, timestamp) not in present}
        if left:
            missing.append((step, left, timestamp))
    return missing


def close_run_from_outside(
    cfg: TrackingConfig, job_dir: Path, run_name: str, tags: dict[str, str], err: BaseException
) -> None:
    """The launching process's last word when the ranks died of `err`: what rank 0 journaled but
    the store did not take (rank 0 killed outright takes its writer with it) and rank 0's log go
    into its run (a new run if rank 0 never got to create one), which ends with the status and
    reason `err` implies; a note on `err` says which run ended how. Raises if the store is down."""
    status, reason = outcome(err)
    if cfg.store.is_server and (down := server_answers(cfg.uri)):
        raise ConnectionError(down)  # rather than MLflow's minutes of retries
    journal, run_id_file, run_log = (job_dir / name for name in (JOURNAL_FILE, RUN_ID_FILE, RUN_LOG_FILE))
    if journal.exists():
        replay(journal, cfg.uri, end=False)  # opens (or creates) the run and names it in run_id_file
    run = _open_run(run_id_file, cfg, run_name, tags)
    if run_log.exists():
        run.log_artifact(run_log, "logs")
    run.finish(status, reason)
    err.add_note(f"run {run.run_id} ended {status}")

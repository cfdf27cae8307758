"""Rank 0's journal of its MLflow run: every call to the writer, appended to a JSON-lines file in the
job's folder before it is queued for the store. Whatever the store did not take (an outage that
outlasted the run, the writer or rank 0 killed) is replayed from it: by the launching process when
rank 0 died, and by `python -m titan_exp sync DIR` (tracking/sync.py). Replaying is idempotent:
metric values the run holds already (same key, step and timestamp) are skipped, params and
artifacts are written again with the same content."""

import dataclasses
import fcntl
import json
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TextIO

from titan_exp.tracking.config import TrackingConfig
from titan_exp.tracking.run import (
    CLAIM_TAG_PREFIX,
    ENDED,
    OWNER_TAG_PREFIX,
    MlflowRun,
    claim,
    now_ms,
    outcome,
    owner_tag,
    write_run_id,
)
from titan_exp.tracking.store import server_answers
from titan_exp.untrusted import regular_file

# In a job's folder: the journal, the id of the run it belongs to (written once the run exists),
# and rank 0's console, which goes into the run as logs/rank0.log.
JOURNAL_FILE = "tracking_journal.jsonl"
RUN_ID_FILE = "mlflow_run_id"
RUN_LOG_FILE = "rank0.log"


class Journal:
    """Appends one line per call and flushes it: a rank killed outright loses at most the line it
    was writing (the operating system holds what was flushed). The writing process holds a lock on
    the file while it lives (the kernel lets it go when it dies, however it dies): `sync` tells a
    job that is gone from one still running by it (is_held)."""

    def __init__(self, path: Path):
        self._file: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by a process still writing it (a job started twice in one folder)
            pass

    def record(self, call: str, *args: object) -> None:
        self._file.write(json.dumps([call, *args], default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def is_held(path: Path) -> bool:
    """Whether a living process writes the file (holds its lock): a journal, a sweep's parent-run
    file. Opened without waiting (a FIFO has no writer to wait for) and never through a link."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)) as file:
        try:
            fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(file, fcntl.LOCK_UN)
    return False


# The calls the writer journals, each with the types of its arguments: a line of any other shape is
# named and skipped (a journal from someone else is not trusted; see replay).
_CALLS: dict[str, tuple[type | tuple[type, ...], ...]] = {
    "create": (dict,),
    "log_params": (dict,),
    "log_metrics": (list,),
    "log_text": (str, str),
    "log_artifact": (str, str),
    "log_artifacts": (str, str),
    "set_tag": (str, str),
    "finish": (str, (str, type(None)), int),
    "leave_open": (str,),  # the job goes on later (a requeue): its run stays open
}
_STATUSES = ("FINISHED", "FAILED", "KILLED")
# Tags the writer never journals: MLflow's own, and a run's claims and owners (the job sets them
# from what it holds, not from what a journal says).
_NOT_JOURNALED = ("mlflow.", CLAIM_TAG_PREFIX, OWNER_TAG_PREFIX)


@dataclass(frozen=True)
class JournalLines:
    calls: list[tuple[int, str, list]]  # (line number, call, arguments), in order
    skipped: list[str]  # "line N: why", for each line not taken


def read(path: Path) -> JournalLines:
    """The journal's calls in order. A last line cut short by a kill (no newline after it) is left
    out silently; any other line that is not a call of the writer's, with arguments of its types and
    values the store takes, is named in `skipped`."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    calls, skipped = [], []
    for number, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deep to be the writer's
            if number < len(lines) or text.endswith("\n"):
                skipped.append(f"line {number}: not JSON")
            continue
        if why := _malformed(entry):
            skipped.append(f"line {number}: {why}")
        else:
            calls.append((number, entry[0], entry[1:]))
    return JournalLines(calls, skipped)


def _malformed(entry: object) -> str | None:
    if not isinstance(entry, list) or not entry or entry[0] not in _CALLS:
        return "not a call of the writer's ([call, arguments...])"
    call, args, types = entry[0], entry[1:], _CALLS[entry[0]]
    if len(args) != len(types) or not all(isinstance(a, t) for a, t in zip(args, types)):
        return f"{call}: arguments of other types or number than the writer's"
    if call == "log_metrics" and not all(_is_metric_record(record) for record in args[0]):
        return "log_metrics: a record that is not [step, {name: number}, timestamp] the store takes"
    if call == "log_params" and not all(_is_name(key) for key in args[0]):
        return "log_params: a name the store does not take"
    if call == "set_tag" and (not _is_name(args[0]) or args[0].startswith(_NOT_JOURNALED)):
        return "set_tag: a name the store does not take, or one of MLflow's own or of a run's claims and owners"
    if call in ("log_text", "log_artifact", "log_artifacts") and not _inside(args[1], call == "log_text"):
        return f"{call}: artifact path {args[1]!r} is not one within the run's artifacts"
    if call == "finish" and (args[0] not in _STATUSES or not 0 <= args[2] <= _INT64_MAX):
        return f"finish: status {args[0]!r} is none of {', '.join(_STATUSES)}, or no time"
    if call == "create" and not (isinstance(args[0].get("run_name"), str) and isinstance(args[0].get("tags"), dict)):
        return "create: no run_name or tags"
    if call == "create" and not isinstance(args[0].get("owner"), str | None):
        return "create: an owner token that is not text"
    return None


def _inside(artifact_path: str, is_file: bool) -> bool:
    """A path within a run's artifacts: relative, with no way up; a file's also names one (not the
    artifacts' root or a folder, which the store cannot write text into)."""
    path = PurePosixPath(artifact_path)
    if is_file and (artifact_path in ("", ".") or artifact_path.endswith("/")):
        return False
    return not path.is_absolute() and ".." not in path.parts and "\\" not in artifact_path


# What MLflow takes as a metric or param name (mlflow/utils/validation.py): one it refuses would fail
# the whole batch, and so the journal's every other value with it.
_NAME = re.compile(r"[/\w.\- :]{1,250}")
_INT64_MAX = 2**63 - 1  # SQLite's and MLflow's steps and timestamps


def _is_name(key: object) -> bool:
    return (
        isinstance(key, str)
        and _NAME.fullmatch(key) is not None
        and posixpath.normpath(key) == key
        and key != "."
        and not key.startswith(("/", ".."))
    )


def _is_metric_record(record: object) -> bool:
    return (
        isinstance(record, list)
        and len(record) == 3
        and isinstance(record[0], int)
        and -_INT64_MAX - 1 <= record[0] <= _INT64_MAX
        and isinstance(record[2], int)
        and 0 <= record[2] <= _INT64_MAX
        and isinstance(record[1], dict)
        and all(_is_name(k) and _is_number(v) for k, v in record[1].items())
    )


def _is_number(value: object) -> bool:
    """A value MLflow keeps as a double (not a bool, not an integer beyond a double's range)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


@dataclass(frozen=True)
class Replayed:
    run_id: str
    metric_values_added: int
    metric_values_present: int
    ended: str | None  # the status the run was ended with here, if it was
    skipped: list[str]  # "line N: why" for each line not replayed
    # The status of a run that had ended before (nothing was written into it), and how many of the
    # journal's metric values it lacks.
    kept: str | None = None
    left_out: int = 0

    @property
    def whole(self) -> bool:
        """Whether the run holds everything the journal does."""
        return not self.skipped and not self.left_out

    def describe(self) -> str:
        skipped = f"; {len(self.skipped)} line(s) not replayed: {'; '.join(self.skipped)}" if self.skipped else ""
        if self.kept:
            lacking = f" ({self.left_out} metric value(s) of the journal it lacks not added)" if self.left_out else ""
            return f"run {self.run_id}: ended {self.kept} before, left as it is{lacking}{skipped}"
        ended = f", ended {self.ended}" if self.ended else ""
        return (
            f"run {self.run_id}: {self.metric_values_added} metric value(s) added, "
            f"{self.metric_values_present} already there{ended}{skipped}"
        )


# Why a run is ended by `sync` when its job is gone without ending it.
GONE_REASON = "the job stopped without ending its run (its processes were killed outright); ended by titan_exp sync"


def replay(journal: Path, cfg: TrackingConfig, end: bool = True) -> Replayed:
    """Write what `journal` records into its run in the store and experiment `cfg` names (the job's,
    never one the journal names), creating the run if it never reached the store; `end`: also end it
    as the journal did, or KILLED when no process writes the journal any more and it neither ended
    the run nor left it open for a requeue. A journal is data, not instructions: it writes only
    into a run that claims this very file (run.claim: not a copy of it), never into a run that has
    ended, sets no `mlflow.*`, claim or owner tag of its own, brings artifacts only from inside its
    job folder, and each line it will not replay is named in `skipped`."""
    claims = claim(journal)  # first: a link or a FIFO is not read
    lines = read(journal)
    skipped = list(lines.skipped)
    created = next((args[0] for _, call, args in reversed(lines.calls) if call == "create"), None)
    if created is None:
        raise ValueError(f"{journal} records no run (no 'create' line)")
    tags = {str(k): str(v) for k, v in created["tags"].items() if not str(k).startswith(_NOT_JOURNALED)}
    parent = created.get("parent_run_id")
    run_cfg = dataclasses.replace(cfg, parent_run_id=parent if isinstance(parent, str) and parent.isalnum() else None)
    start_ms = created.get("start_ms")
    start_ms = start_ms if isinstance(start_ms, int) and 0 <= start_ms <= _INT64_MAX else None
    owner = created.get("owner")
    run, status = _open_run(journal.parent / RUN_ID_FILE, run_cfg, created["run_name"], tags, claims, owner, start_ms)
    calls = lines.calls
    records = [tuple(record) for _, call, args in calls if call == "log_metrics" for record in args[0]]
    missing = _missing_metric_values(run, records)
    added = sum(len(metrics) for _, metrics, _ in missing)
    total = sum(len(metrics) for _, metrics, _ in records)
    if status in ENDED:  # its record is whole as it ended: nothing more goes in, whatever the journal says
        return Replayed(run.run_id, 0, total - added, None, skipped, kept=status, left_out=added)
    params = {str(k): str(v) for _, call, args in calls if call == "log_params" for k, v in args[0].items()}
    if params:
        run.log_params(params)
    for _, call, args in calls:
        if call == "set_tag":
            run.set_tag(*args)
    if missing:
        run.log_metrics(missing)
    skipped += _replay_artifacts(run, calls, journal.parent)
    finish = _end(journal, calls, records) if end else None
    if finish and run.status_and_tags()[0] in ENDED:  # its job ended it meanwhile
        finish = None
    if finish:
        run.finish(*finish)
    return Replayed(run.run_id, added, total - added, finish[0] if finish else None, skipped)


def _end(journal: Path, calls: list[tuple[int, str, list]], records: list[tuple]) -> list | None:
    """How the run ends: as the journal ended it; KILLED where its job is gone without a word (as of
    its last metric); None where it is left open or its job still runs."""
    last = next((args for _, call, args in reversed(calls) if call in ("finish", "leave_open")), None)
    if last is not None:
        return last if len(last) == 3 else None
    if is_held(journal):
        return None
    return ["KILLED", GONE_REASON, max((record[2] for record in records), default=now_ms())]


def _replay_artifacts(run: MlflowRun, calls: list[tuple[int, str, list]], job_dir: Path) -> list[str]:
    """The journal's texts and artifacts into the run; each artifact that would bring in a file from
    outside the job folder (a path there, or a link out of it), or is gone, is named instead."""
    skipped = []
    for number, call, args in calls:
        if call not in ("log_text", "log_artifact", "log_artifacts"):
            continue
        try:  # a line the store refuses (a file where it keeps a folder) is named; the rest go on
            if call == "log_text":
                run.log_text(*args)
                continue
            path = job_dir / args[0]  # the writer's paths are absolute; a relative one is the job's
            if _leaves(path, job_dir):
                skipped.append(f"line {number}: {call} {args[0]} brings in a file from outside {job_dir}")
            elif call == "log_artifact" and path.is_file():
                run.log_artifact(path, args[1])
            elif call == "log_artifacts" and path.is_dir():
                run.log_artifacts(path, args[1])
            else:
                kind = "file" if call == "log_artifact" else "folder"
                skipped.append(f"line {number}: {call} {args[0]}: no such {kind}")
        except Exception as err:
            skipped.append(f"line {number}: {call}: not written ({type(err).__name__}: {err})")
    return skipped


def _leaves(path: Path, job_dir: Path) -> bool:
    """Whether `path`, or a file under it, is outside `job_dir` once links are followed."""
    inside = job_dir.resolve()
    files = [path, *path.rglob("*")] if path.is_dir() else [path]
    return not all(f.resolve().is_relative_to(inside) for f in files)


def _open_run(
    run_id_file: Path,
    cfg: TrackingConfig,
    run_name: str,
    tags: dict[str, str],
    claims: dict[str, str] | None,
    owner: str | None,
    start_ms: int | None = None,
) -> tuple[MlflowRun, str]:
    """The run `run_id_file` names and its status, if it carries `claims` (its journal's, run.claim;
    else a refusal: a folder from someone else, or a copy of the job's, may name any run), or a new
    one (its id then written there). Never through a link: one planted there would have us write
    the id wherever it points."""
    if run_id_file.is_symlink():
        raise ValueError(f"{run_id_file} is a symbolic link; remove it (it should hold a run id)")
    if run_id_file.exists():
        run_id = read_run_id(run_id_file)
        run = MlflowRun(cfg.uri, run_id)
        status, run_tags = run.status_and_tags()
        if claims is None or not claims.keys() <= run_tags.keys():
            raise ValueError(
                f"run {run_id} was not written through this folder's {JOURNAL_FILE} (a copy of the job's folder, "
                "or one moved since the run began); sync the folder the job wrote"
            )
        return run, status
    tags = {**tags, **(claims or {}), **({owner_tag(owner): "1"} if owner is not None else {})}
    run = MlflowRun.create(cfg, run_name, tags, start_ms)
    write_run_id(run_id_file, run.run_id, owner)
    return run, "RUNNING"


# A run id (MLflow's are 32 hex digits), and the most a file holding one may hold.
_MAX_RUN_ID_CHARS = 64
MAX_RUN_ID_BYTES = 4 * _MAX_RUN_ID_CHARS


def is_run_id(text: str) -> bool:
    """Whether `text` can be a run id of ours (nothing else is printed or asked of the store)."""
    return text.isascii() and text.isalnum() and len(text) <= _MAX_RUN_ID_CHARS


def read_run_id(path: Path) -> str:
    """The run id a file in a job's folder holds: a regular file (a FIFO would block) of a few bytes."""
    if regular_file(path) > MAX_RUN_ID_BYTES:
        raise ValueError(f"{path} holds no run id (it is larger than one)")
    run_id = path.read_text(encoding="utf-8", errors="replace").strip()
    if not is_run_id(run_id):
        raise ValueError(f"{path} holds no run id")
    return run_id


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
    if journal.exists():  # the run it opened, or created and named in run_id_file
        run = MlflowRun(cfg.uri, replay(journal, cfg, end=False).run_id)
    else:
        run = _open_run(run_id_file, cfg, run_name, tags, claims=None, owner=None)[0]
    if run_log.exists():
        run.log_artifact(run_log, "logs")
    run.finish(status, reason)  # the job's own word: over rank 0's, which saw only its part
    err.add_note(f"run {run.run_id} ended {status}")

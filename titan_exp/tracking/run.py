"""One MLflow run, written through the client: params, metrics, artifacts, tags, and its end
(FINISHED, FAILED or KILLED, with the reason)."""

import functools
import getpass
import hashlib
import os
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from titan_exp.tracking.config import TrackingConfig
from titan_exp.tracking.store import client, experiment_id, with_retries

# MLflow's per-call limits for log_batch.
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAM_LENGTH = 6000
_MAX_TAG_LENGTH = 5000
# MLflow's tag that nests a run under another in the UI and in search.
PARENT_TAG = "mlflow.parentRunId"
# Set to "sweep" on a parent run over several jobs (a sweep, a parity check), which trains nothing itself.
ROLE_TAG = "titan_exp.role"
# The param of a training run listing the config keys its layout does not read (comma-separated):
# a comparison shows no value of theirs for it.
UNREAD_KEYS_PARAM = "derived/unread_keys"
# The param of a sweep's parent run holding the sweep's overrides, as given (its comma lists), quoted
# for a shell (a glob in data.paths).
SWEEP_OVERRIDES_PARAM = "sweep.overrides"
# The param of a training run on a GPU naming the hardware profile that stands for its device
# (`hardware` itself names what a plan predicts for, `cpu` unless told).
DEVICE_PROFILE_PARAM = "derived/device_profile"
# A run's owners: each job that wrote it keeps a random token in its journal (tracking/journal.py) and
# beside its checkpoints' run-id file, and tags the run with the token's hash under this prefix: a
# job resumed from those checkpoints goes on in the run only if it carries the tag (why_not_go_on_in).
OWNER_TAG_PREFIX = "titan_exp.owner."
# A run's claims: each file whose folder may write the run later (a job's journal, which `sync`
# replays; a sweep's parent-run file) tags it, when the job creates or re-opens the run, with the
# hash of the file's identity under this prefix (its path as the value, for people). A copy of the
# folder holds other files and so no claim: whatever it says, it writes nothing into the run.
CLAIM_TAG_PREFIX = "titan_exp.claim."
# A run that has ended keeps its end: nothing replayed later changes it.
ENDED = ("FINISHED", "FAILED", "KILLED")


def owner_tag(token: str) -> str:
    return OWNER_TAG_PREFIX + hashlib.sha256(token.encode()).hexdigest()[:32]


def claim(path: Path) -> dict[str, str]:
    """The tag by which a run is claimed for the file at `path`. Its identity: its absolute path (the
    folder's links resolved) and its inode number. A copy has another inode (while the original
    exists) and, unless it replaced the original in the job's own folder, another path; a hard link
    elsewhere has another path. Not the device number: a shared file system gives each host's mount
    its own (NFS) and a reboot may renumber a disk, while the path already names the file system.
    Only a regular file has a claim: a link would claim the file it points to."""
    real = path.parent.resolve() / path.name
    info = os.lstat(real)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file (a link, a FIFO, a folder?); the job writes it as one")
    identity = hashlib.sha256(f"{real}\0{info.st_ino}".encode()).hexdigest()[:32]
    return {CLAIM_TAG_PREFIX + identity: str(real)}


def write_run_id(path: Path, run_id: str, owner: str | None = None) -> None:
    """The id file (and beside it, where given, the writing job's owner token: a job that resumes
    from a checkpoint folder proves with it that the run is that folder's), each written whole or
    not at all (a full disk leaves the old one or none, never an empty one), and never through a
    link planted there."""
    if owner is not None:
        _write_whole(owner_file(path), owner)
    _write_whole(path, run_id)


def owner_file(run_id_file: Path) -> Path:
    return run_id_file.with_name(run_id_file.name + ".owner")


def owner_beside(run_id_file: Path) -> str | None:
    """The owner token written beside a run-id file (None: there is none, or it is no token)."""
    path = owner_file(run_id_file)
    if path.is_symlink() or not path.is_file() or path.stat().st_size > 256:
        return None
    return path.read_text(errors="replace").strip() or None


def _write_whole(path: Path, text: str) -> None:
    fd, draft = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(draft, path)
    except BaseException:
        Path(draft).unlink(missing_ok=True)
        raise


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def origin_tags() -> dict[str, str]:
    """Where and from which code a run was made."""
    return {"hostname": socket.gethostname(), "user": getpass.getuser(), "git_commit": git_commit()}


class MlflowRun:
    def __init__(self, uri: str, run_id: str):
        self.client = client(uri)
        self.run_id = run_id

    @classmethod
    def reopen(cls, uri: str, run_id: str, owner: str, claims: dict[str, str] | None = None) -> "MlflowRun | None":
        """That run of this store, RUNNING again if it had ended (a job resumed from its checkpoint
        after a failure goes on in the run that saved it), tagged as written by the job of token
        `owner` too, and with `claims` (claim(): this job's journal); None if the store has no such run."""
        from mlflow.exceptions import MlflowException

        run = cls(uri, run_id)
        try:
            found = with_retries(lambda: run.client.get_run(run_id))
        except MlflowException:
            return None
        # First: this job may resume into it, and its journal be replayed into it, from now on.
        for key, value in {owner_tag(owner): "1", **(claims or {})}.items():
            run.set_tag(key, value)
        if found.info.status != "RUNNING":
            with_retries(lambda: run.client.update_run(run_id, status="RUNNING"))
            run.set_tag("status", "running")
        if "failure_reason" in found.data.tags:  # the earlier end's reason no longer holds
            with_retries(lambda: run.client.delete_tag(run_id, "failure_reason"))
        return run

    @classmethod
    def create(
        cls, cfg: TrackingConfig, run_name: str, tags: dict[str, str], start_ms: int | None = None
    ) -> "MlflowRun":
        """A new run; `start_ms`: when the job asked for it (now if None), so that a writer that
        starts later, or a journal replayed afterwards, still gives the run the job's own start."""
        mlflow_client = client(cfg.uri)
        tags = {**origin_tags(), **tags}
        if cfg.parent_run_id:
            tags[PARENT_TAG] = cfg.parent_run_id
        run = with_retries(
            lambda: mlflow_client.create_run(
                experiment_id(mlflow_client, cfg), start_time=start_ms, run_name=run_name, tags=tags
            )
        )
        return cls(cfg.uri, run.info.run_id)

    def log_params(self, params: dict[str, object]) -> None:
        """The params the run does not have yet: a run re-attached after a requeue keeps what its
        first attempt logged (MLflow refuses to change a param, and a figure measured at the start,
        as a CPU's peak FLOP/s, may come out otherwise the second time)."""
        from mlflow.entities import Param

        logged = with_retries(lambda: self.client.get_run(self.run_id)).data.params
        items = [Param(k, str(v)[:_MAX_PARAM_LENGTH]) for k, v in params.items() if k not in logged]
        for chunk in _chunks(items, _MAX_PARAMS_PER_BATCH):
            with_retries(functools.partial(self.client.log_batch, self.run_id, params=chunk))

    def log_metrics(self, records: list[tuple[int, dict[str, float], int]]) -> None:
        """records: (step, {name: value}, timestamp in ms), written in as few calls as MLflow allows."""
        from mlflow.entities import Metric

        items = [
            Metric(k, float(v), timestamp, step) for step, metrics, timestamp in records for k, v in metrics.items()
        ]
        for chunk in _chunks(items, _MAX_METRICS_PER_BATCH):
            with_retries(functools.partial(self.client.log_batch, self.run_id, metrics=chunk))

    def log_text(self, text: str, artifact_file: str) -> None:
        with_retries(lambda: self.client.log_text(self.run_id, text, artifact_file))

    def log_artifact(self, path: Path, artifact_dir: str) -> None:
        with_retries(lambda: self.client.log_artifact(self.run_id, str(path), artifact_dir))

    def metric_history(self, key: str) -> list:
        return with_retries(lambda: self.client.get_metric_history(self.run_id, key))

    def log_artifacts(self, folder: Path, artifact_dir: str) -> None:
        with_retries(lambda: self.client.log_artifacts(self.run_id, str(folder), artifact_dir))

    def set_tag(self, key: str, value: str) -> None:
        with_retries(lambda: self.client.set_tag(self.run_id, key, value[:_MAX_TAG_LENGTH]))

    def children(self) -> list:
        """The runs nested under this one (a sweep's points), in its experiment."""
        experiment = with_retries(lambda: self.client.get_run(self.run_id)).info.experiment_id
        nested = f"tags.`{PARENT_TAG}` = '{self.run_id}'"
        return with_retries(lambda: self.client.search_runs([experiment], nested, max_results=50_000))

    def status_and_tags(self) -> tuple[str, dict[str, str]]:
        found = with_retries(lambda: self.client.get_run(self.run_id))
        return found.info.status, dict(found.data.tags)

    def finish(self, status: str, reason: str | None = None, end_ms: int | None = None) -> None:
        """status: FINISHED | FAILED | KILLED, also kept as the `status` tag (with `failure_reason`);
        `end_ms`: when the job ended (now if None)."""
        self.set_tag("status", status.lower())
        if reason:
            self.set_tag("failure_reason", reason)
        with_retries(lambda: self.client.set_terminated(self.run_id, status=status, end_time=end_ms))


def why_not_go_on_in(uri: str, run_id: str, owner: str | None, expects: dict[str, object]) -> str | None:
    """Why a job may not go on writing run `run_id` (None: it may): only a run that carries the tag
    of `owner` (the token beside the run-id file: the run wrote it), did not finish, and logged each
    of `expects` as this job has it (its checkpoint folder, its model) is the run of the job's
    checkpoint. A run-id file alone proves nothing (it may be copied, or crafted), and a finished
    run's record stays as it ended."""
    from mlflow.exceptions import MlflowException

    try:
        found = with_retries(lambda: client(uri).get_run(run_id))
    except MlflowException:
        return f"the store has no run {run_id}"
    if owner is None or owner_tag(owner) not in found.data.tags:
        return f"run {run_id} carries no tag of the token beside its id (a copied or crafted run-id file)"
    if found.info.status == "FINISHED":
        return f"run {run_id} finished; its record stays as it is"
    for key, value in expects.items():
        if (logged := found.data.params.get(key)) != str(value)[:_MAX_PARAM_LENGTH]:
            return f"run {run_id} logged {key}={logged}, this job has {value}"
    return None


def changed_params(uri: str, run_id: str, params: dict[str, object]) -> dict[str, str]:
    """Those of `params` that run `run_id` did not log as they are (MLflow keeps a run's first value
    of a param: a job that goes on in the run records its own another way)."""
    logged = with_retries(lambda: client(uri).get_run(run_id)).data.params
    mine = {key: str(value)[:_MAX_PARAM_LENGTH] for key, value in params.items()}
    return {key: value for key, value in mine.items() if logged.get(key) != value}


def now_ms() -> int:
    """The time as MLflow keeps it (ms since the epoch)."""
    return int(time.time() * 1000)


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def outcome(err: BaseException) -> tuple[str, str]:
    """(MLflow status, failure reason) of a run that `err` ended: KILLED when interrupted (Ctrl-C,
    SIGTERM, an error that says `interrupted`, such as a cancelled Slurm job), else FAILED."""
    interrupted = isinstance(err, KeyboardInterrupt) or getattr(err, "interrupted", False)
    status = "KILLED" if interrupted else "FAILED"
    return status, f"{type(err).__name__}: {err}" if str(err) else type(err).__name__

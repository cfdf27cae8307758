"""`python -m titan_exp sync DIR...`: write into the store what jobs journaled but the store did not
take (tracking/journal.py). DIR is a job's folder or any folder above jobs (a sweep's, outputs/):
every journal under it is replayed, into the store the job was configured with (its folder's, or
the nearest folder above's, `.hydra/config.yaml`; the journal's own word is not taken), which must
exist already, or the one given with --uri; only into a run that claims that very journal (not a
copy's: run.claim) and has not ended. Then each sweep's parent run under DIR that its sweep left
open is ended, once its points have (tracking/parent_run.py). Idempotent: run it as often as you
like. A journal is data: a line that is not the writer's, or would bring in a file from outside
the job folder, is named (line number and why) beside its journal's summary and skipped, the rest
replayed all the same. Exit status: 0 when every journal was replayed whole (or its run ended
holding all of it); 1 when a line was skipped, an ended run lacks values of its journal, or a
folder was not synced at all (named on stderr), after the rest were; 2 when there is nothing to sync."""

import argparse
import os
import sys
from pathlib import Path

from titan_exp.rules import ConfigError
from titan_exp.tracking.config import SQLITE_PREFIX, TrackingConfig, masked
from titan_exp.tracking.journal import JOURNAL_FILE, replay
from titan_exp.tracking.parent_run import PARENT_RUN_FILE, end_if_gone
from titan_exp.tracking.store import MLFLOW_TABLES, not_a_store, read_only, server_answers
from titan_exp.untrusted import plain_yaml, read_text, regular_file

# A job's saved config is a few kB (Hydra's own record of a sweep, a few tens), a few levels deep.
_MAX_SAVED_CONFIG_BYTES = 1 << 20
_MAX_SAVED_CONFIG_DEPTH = 32


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="titan_exp sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="job folders, or folders above them")
    parser.add_argument("--uri", help="write into this store instead of the one each job was configured with")
    args = parser.parse_args(argv)
    journals = sorted({journal for folder in args.dirs for journal in folder.rglob(JOURNAL_FILE)})
    parents = sorted({found for folder in args.dirs for found in folder.rglob(PARENT_RUN_FILE)})
    if not journals and not parents:
        print(f"titan_exp sync: no {JOURNAL_FILE} under {', '.join(map(str, args.dirs))}", file=sys.stderr)
        return 2
    failed = 0
    # The jobs first: a sweep's parent run is ended only once they have.
    for found in [*journals, *parents]:
        try:
            cfg = _job_store(found.parent, args.uri)
            if found.name == JOURNAL_FILE:
                replayed = replay(found, cfg)
                said, failed = replayed.describe(), failed + (not replayed.whole)
            else:
                said = end_if_gone(found, cfg.uri)
            # The store is named: the job's config chose it, and that may not be the one expected.
            print(f"{found.parent} into {masked(cfg.uri)}: {said}", flush=True)
        except Exception as err:
            failed += 1
            print(f"{found.parent}: not synced: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    return 1 if failed else 0


def _job_store(job_dir: Path, uri: str | None) -> TrackingConfig:
    """The store and experiment the job in `job_dir` was configured with (`uri` instead of its
    store), as the nearest folder's saved config says (a job's `.hydra/config.yaml`, a sweep's
    `multirun.yaml`). That config is data from the folder, read within bounds (_read_yaml), and the
    store it names must exist and be an MLflow store: sync never creates one where a folder points
    (one given with --uri is the user's own word)."""
    task, hydra = _saved_config(job_dir)
    tracking = _at(task, "tracking")
    tracking = tracking if isinstance(tracking, dict) else {}
    if uri is None and not isinstance(tracking.get("uri"), str):
        raise ValueError(f"no .hydra/config.yaml in {job_dir} or above names its store; give one with --uri")
    configured = uri is None
    if configured:
        uri = tracking["uri"]
        if uri.startswith(SQLITE_PREFIX) and not Path(uri[len(SQLITE_PREFIX) :]).is_absolute():
            # The job's relative SQLite path is its launch directory's, which Hydra kept.
            uri = SQLITE_PREFIX + str(Path(_launched_in(hydra)) / uri[len(SQLITE_PREFIX) :])
    cfg = TrackingConfig(uri=uri, experiment=str(tracking.get("experiment", "titan_exp")))
    try:
        cfg.check("tracking")
    except ConfigError as err:
        raise ValueError(f"the job's tracking config is not one titan_exp writes to: {err}") from None
    _check_store(cfg, must_exist=configured)
    return cfg


def _saved_config(job_dir: Path) -> tuple[dict | None, Path | None]:
    """(the task's config, the file holding Hydra's own) of the nearest folder, `job_dir` or above,
    that Hydra saved them in: a job's .hydra/ or a sweep's multirun.yaml (both in one)."""
    for folder in (job_dir, *job_dir.parents):
        if os.path.lexists(folder / ".hydra" / "config.yaml"):
            return _read_yaml(folder / ".hydra" / "config.yaml"), folder / ".hydra" / "hydra.yaml"
        if os.path.lexists(folder / "multirun.yaml"):
            return _read_yaml(folder / "multirun.yaml"), folder / "multirun.yaml"
    return None, None


def _launched_in(hydra_file: Path) -> str:
    """The folder the job was launched from (Hydra's runtime.cwd)."""
    cwd = _at(_read_yaml(hydra_file), "hydra", "runtime", "cwd")
    if not isinstance(cwd, str):
        raise ValueError(f"{hydra_file} names no launch folder (hydra.runtime.cwd) for the job's relative store")
    return cwd


def _at(config: object, *keys: str) -> object:
    """The value under `keys` in nested mappings (None where there is none)."""
    for key in keys:
        config = config.get(key) if isinstance(config, dict) else None
    return config


def _read_yaml(path: Path) -> dict:
    """A config Hydra saved, as plain data: a regular file (not a FIFO or a device) within
    _MAX_SAVED_CONFIG_BYTES, without aliases or Python objects (untrusted.plain_yaml), a mapping."""
    value = plain_yaml(read_text(path, _MAX_SAVED_CONFIG_BYTES), str(path), _MAX_SAVED_CONFIG_DEPTH)
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a config Hydra saved (a {type(value).__name__}, not a mapping)")
    return value


def _check_store(cfg: TrackingConfig, must_exist: bool) -> None:
    """A store sync may write into: a server that answers (not minutes of MLflow's retries), or a
    SQLite file that is not another application's; `must_exist`: one with MLflow's tables already."""
    db = cfg.store.db
    if db is None:
        if down := server_answers(cfg.uri):
            raise ValueError(down)
        return
    if why := not_a_store(db):
        raise ValueError(why)
    if must_exist and not (os.path.lexists(db) and regular_file(db) and MLFLOW_TABLES <= _tables(db)):
        raise ValueError(f"no MLflow store at {db} (sync never creates one where a folder points); give one with --uri")


def _tables(db: Path) -> set[str]:
    with read_only(db) as conn:
        return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

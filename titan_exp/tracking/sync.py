"""`python -m titan_exp sync DIR...`: write into the store what jobs journaled but the store did not
take (tracking/journal.py). DIR is a job's folder or any folder above jobs (a sweep's, outputs/):
every journal under it is replayed, into the store the job was configured with (its folder's, or
the nearest folder above's, `.hydra/config.yaml`; the journal's own word is not taken) or the one
given with --uri. Idempotent: run it as often as you like. A journal is data: a line that is not
the writer's, or would bring in a file from outside the job folder, is named (line number and why)
beside its journal's summary and skipped, the rest replayed all the same. Exit status: 0 when every
journal was replayed whole; 1 when a line was skipped or a journal not synced at all (named on
stderr), after the rest were; 2 when there is no journal."""

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf

from titan_exp.rules import ConfigError
from titan_exp.tracking.config import SQLITE_PREFIX, TrackingConfig, masked
from titan_exp.tracking.journal import JOURNAL_FILE, replay


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="titan_exp sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="job folders, or folders above them")
    parser.add_argument("--uri", help="write into this store instead of the one each job was configured with")
    args = parser.parse_args(argv)
    journals = sorted({journal for folder in args.dirs for journal in folder.rglob(JOURNAL_FILE)})
    if not journals:
        print(f"titan_exp sync: no {JOURNAL_FILE} under {', '.join(map(str, args.dirs))}", file=sys.stderr)
        return 2
    failed = 0
    for journal in journals:
        try:
            cfg = _job_store(journal.parent, args.uri)
            replayed = replay(journal, cfg)
            # The store is named: the job's config chose it, and that may not be the one expected.
            print(f"{journal.parent} into {masked(cfg.uri)}: {replayed.describe()}", flush=True)
            failed += bool(replayed.skipped)
        except Exception as err:
            failed += 1
            print(f"{journal.parent}: not synced: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    return 1 if failed else 0


def _job_store(job_dir: Path, uri: str | None) -> TrackingConfig:
    """The store and experiment the job in `job_dir` was configured with (`uri` instead of its store)."""
    hydra = next((d / ".hydra" for d in (job_dir, *job_dir.parents) if (d / ".hydra" / "config.yaml").is_file()), None)
    tracking = OmegaConf.load(hydra / "config.yaml").get("tracking", {}) if hydra else {}
    if uri is None and "uri" not in tracking:
        raise ValueError(f"no .hydra/config.yaml in {job_dir} or above names its store; give one with --uri")
    if uri is None:
        uri = tracking["uri"]
        if uri.startswith(SQLITE_PREFIX) and not Path(uri[len(SQLITE_PREFIX) :]).is_absolute():
            # The job's relative SQLite path is its launch directory's, which Hydra kept.
            launched_in = OmegaConf.load(hydra / "hydra.yaml").hydra.runtime.cwd
            uri = SQLITE_PREFIX + str(Path(launched_in) / uri[len(SQLITE_PREFIX) :])
    cfg = TrackingConfig(uri=uri, experiment=tracking.get("experiment", "titan_exp"))
    try:
        cfg.check("tracking")
    except ConfigError as err:
        raise ValueError(f"the job's tracking config is not one titan_exp writes to: {err}") from None
    return cfg

"""`python -m titan_exp sync DIR...`: write into the store what jobs journaled but the store did not
take (tracking/journal.py). DIR is a job's folder or any folder above jobs (a sweep's, outputs/):
every journal under it is replayed. Idempotent: run it as often as you like."""

import argparse
import sys
from pathlib import Path

from titan_exp.tracking.journal import JOURNAL_FILE, replay


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_exp sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="job folders, or folders above them")
    parser.add_argument("--uri", help="write into this store instead of the one each job was tracked in")
    args = parser.parse_args(argv)
    journals = sorted({journal for folder in args.dirs for journal in folder.rglob(JOURNAL_FILE)})
    if not journals:
        print(f"titan_exp sync: no {JOURNAL_FILE} under {', '.join(map(str, args.dirs))}", file=sys.stderr)
        return 2
    failed = 0
    for journal in journals:
        try:
            print(f"{journal.parent}: {replay(journal, args.uri).describe()}", flush=True)
        except Exception as err:
            failed += 1
            print(f"{journal.parent}: not synced: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    return 1 if failed else 0

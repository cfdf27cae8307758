"""One point of a sweep, in a process of its own: `python -m titan_exp.job.point DIR` runs the
resolved job the sweep left in DIR (job/sweep_points.py) as `python -m titan_exp` runs a job, and
reports and exits as it does (job/outcome.py), its end also as an event for the sweep's board
(job/events.py). Nothing is composed, resolved or checked again."""

import pickle
import signal
import sys
from pathlib import Path

from launchers import signals
from titan_exp.job import events
from titan_exp.job.launch import run_job
from titan_exp.job.outcome import say, verdict
from titan_exp.job.sweep_points import JOB_FILE


def main(job_dir: Path) -> int:
    with open(job_dir / JOB_FILE, "rb") as f:
        job = pickle.load(f)
    try:
        with signals.handled(signals.raise_interrupted, signal.SIGTERM):
            run_job(job, job_dir)
    except BaseException as err:
        status, line = verdict(err)
        say(line)
        events.emit(job_dir, events.END, ok=False, reason=line)
        return status
    events.emit(job_dir, events.END, ok=True, reason="")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

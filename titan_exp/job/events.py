"""A job's state as its processes report it: one JSON object a line in <job dir>/events.jsonl
(where its engine placed it, each logged step from rank 0, how it ended), appended whole by a
single write each. A sweep's board reads them (job/sweep_points.py); the console is only a view of
the same, never parsed. Torch-free."""

import json
from pathlib import Path

EVENTS_FILE = "events.jsonl"

# Kinds, and the fields each carries.
PLACED = "placed"  # where: the engine's words ("Slurm job 123")
STEP = "step"  # step, loss
END = "end"  # ok (bool), reason (why it failed, one line)


def emit(job_dir: Path | str, kind: str, **fields: object) -> None:
    """Append one event to the job's file."""
    line = json.dumps({"event": kind, **fields}) + "\n"
    with open(Path(job_dir) / EVENTS_FILE, "a") as file:
        file.write(line)


class EventReader:
    """The events a job's file gains, read as they come (a line still being written waits)."""

    def __init__(self, job_dir: Path):
        self.path = job_dir / EVENTS_FILE
        self._offset = 0

    def new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as file:
            file.seek(self._offset)
            chunk = file.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

"""How checkpoints lie in `checkpoint.folder`: one `step-N` folder per saved step, complete once
it is there (saved as `step-N.saving`, renamed when the save has ended). Torch-free: the config
checks read it."""

import re
from pathlib import Path

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(folder: str, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def saving_dir(folder: str, step: int) -> Path:
    """Where step N is written until it is complete."""
    return Path(folder) / f"step-{step}.saving"


def complete_steps(folder: str) -> list[int]:
    """The steps with a complete checkpoint (a step-N folder with DCP's .metadata), oldest first."""
    steps = [
        int(m.group(1))
        for p in Path(folder).glob("step-*")
        if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").exists()
    ]
    return sorted(steps)


def latest_step(folder: str) -> int | None:
    steps = complete_steps(folder)
    return steps[-1] if steps else None

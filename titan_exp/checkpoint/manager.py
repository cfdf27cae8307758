"""Distributed checkpoints (torch.distributed.checkpoint): each rank writes and reads only its shards,
and a checkpoint written by one layout loads into any other (DCP reshards by parameter name)."""

import re
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict, get_model_state_dict, set_model_state_dict

from titan_exp.checkpoint.config import CheckpointConfig

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(folder: str, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def latest_step(folder: str) -> int | None:
    """The newest complete step folder (DCP writes .metadata last), or None."""
    steps = [
        int(m.group(1))
        for p in Path(folder).glob("step-*")
        if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").exists()
    ]
    return max(steps) if steps else None


def save_model(model: torch.nn.Module, path: Path) -> None:
    """Weights only, keyed by the unwrapped parameter names (a seed checkpoint)."""
    dcp.save(get_model_state_dict(model), checkpoint_id=str(path))


def load_model(model: torch.nn.Module, path: str) -> None:
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)


class TrainCheckpointer:
    """Periodic save / resume of model, optimizer, LR schedule and step."""

    def __init__(self, cfg: CheckpointConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler):
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler

    def _state(self) -> dict:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optim_state, "lr_scheduler": self.scheduler.state_dict(), "step": torch.tensor(0)}

    def resume(self) -> int:
        """Load the newest checkpoint of cfg.folder; returns its step (0 when there is none)."""
        step = latest_step(self.cfg.folder) if self.cfg.enable else None
        if step is None:
            return 0
        state = self._state()
        dcp.load(state, checkpoint_id=str(step_dir(self.cfg.folder, step)))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        return int(state["step"])

    def maybe_save(self, step: int, last_step: int, is_writer: bool) -> None:
        if not self.cfg.enable or (step % self.cfg.interval and step != last_step):
            return
        state = self._state()
        state["step"] = torch.tensor(step)
        dcp.save(state, checkpoint_id=str(step_dir(self.cfg.folder, step)))
        if is_writer and self.cfg.keep_latest_k > 0:
            self._prune()

    def _prune(self) -> None:
        steps = sorted(int(m.group(1)) for p in Path(self.cfg.folder).glob("step-*") if (m := _STEP_DIR.match(p.name)))
        for old in steps[: -self.cfg.keep_latest_k]:
            shutil.rmtree(step_dir(self.cfg.folder, old), ignore_errors=True)

"""Distributed checkpoints (torch.distributed.checkpoint): each rank writes and reads only its shards,
and a checkpoint written by one layout loads into any other (DCP reshards by parameter name)."""

import re
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

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
    """Periodic save / resume of model, optimizer, LR schedule and step.

    A rank may hold several model parts (pipeline stages), each with its own optimizer. Their state
    dicts are keyed by canonical parameter names (optimizer state flattened to one key per tensor),
    so the parts merge into one checkpoint that any layout can load.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        parts: list[torch.nn.Module],
        optimizers: list[torch.optim.Optimizer],
        schedulers: list,
    ):
        self.cfg, self.parts, self.optimizers, self.schedulers = cfg, parts, optimizers, schedulers
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def _part_states(self) -> list[tuple[dict, dict]]:
        return [
            get_state_dict(part, optimizer, options=self.options)
            for part, optimizer in zip(self.parts, self.optimizers)
        ]

    def _merged(self, part_states: list[tuple[dict, dict]], step: int) -> dict:
        model: dict = {}
        optimizer: dict = {}
        for model_state, optim_state in part_states:
            model.update(model_state)
            optimizer.update(optim_state)
        # Every part's scheduler follows the same schedule: one state serves them all.
        return {
            "model": model,
            "optimizer": optimizer,
            "lr_scheduler": self.schedulers[0].state_dict(),
            "step": torch.tensor(step),
        }

    def resume(self) -> int:
        """Load the newest checkpoint of cfg.folder; returns its step (0 when there is none)."""
        step = latest_step(self.cfg.folder) if self.cfg.enable else None
        if step is None:
            return 0
        part_states = self._part_states()
        state = self._merged(part_states, 0)
        dcp.load(state, checkpoint_id=str(step_dir(self.cfg.folder, step)))
        # DCP loads tensors in place but replaces plain values (such as an lr) in the merged dicts:
        # hand each part its entries from there.
        for part, optimizer, (model_state, optim_state) in zip(self.parts, self.optimizers, part_states):
            set_state_dict(
                part,
                optimizer,
                model_state_dict={k: state["model"][k] for k in model_state},
                optim_state_dict={k: state["optimizer"][k] for k in optim_state},
                options=self.options,
            )
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state["lr_scheduler"])
        return int(state["step"])

    def maybe_save(self, step: int, last_step: int, is_writer: bool) -> bool:
        """Save every cfg.interval steps and at the last step; returns whether it saved."""
        if not self.cfg.enable or (step % self.cfg.interval and step != last_step):
            return False
        self.save(step, is_writer)
        return True

    def save(self, step: int, is_writer: bool) -> None:
        """Save `step` now (every rank takes part); `is_writer` prunes old step folders."""
        dcp.save(self._merged(self._part_states(), step), checkpoint_id=str(step_dir(self.cfg.folder, step)))
        if is_writer and self.cfg.keep_latest_k > 0:
            self._prune()

    def _prune(self) -> None:
        steps = sorted(int(m.group(1)) for p in Path(self.cfg.folder).glob("step-*") if (m := _STEP_DIR.match(p.name)))
        for old in steps[: -self.cfg.keep_latest_k]:
            shutil.rmtree(step_dir(self.cfg.folder, old), ignore_errors=True)

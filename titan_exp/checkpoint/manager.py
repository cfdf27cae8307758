"""Distributed checkpoints (torch.distributed.checkpoint): each rank writes and reads only its shards,
and a checkpoint written by one layout loads into any other (DCP reshards by parameter name).
Where they lie in the folder: checkpoint/layout.py."""

import functools
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from launchers.tasks import last_line
from titan_exp.checkpoint.config import CheckpointConfig
from titan_exp.checkpoint.errors import UntrustedCheckpointError, unwrapped
from titan_exp.checkpoint.hf import save_hf
from titan_exp.checkpoint.layout import NotEnoughSpaceError, complete_steps, exporting_dir, saving_dir, step_dir
from titan_exp.checkpoint.model_record import TrainingRecord, write_model_record
from titan_exp.checkpoint.space import SpaceCheckingPlanner
from titan_exp.checkpoint.staging import MARK, make_fresh, remove_ours
from titan_exp.checkpoint.trusted import load_trusted, open_checkpoint
from titan_exp.data.loader import BatchLoader
from titan_exp.dependency_warnings import ignore_unavoidable_warnings
from titan_exp.models.config import ModelConfig
from titan_exp.optim.lr_schedule import follow_this_schedule
from titan_exp.optim.optimizer import Optimizers


def save_whole(
    state: dict,
    folder: str,
    step: int,
    model: ModelConfig,
    is_writer: bool,
    also: Callable[[Path], None] | None = None,
    training: TrainingRecord | None = None,
) -> None:
    """Save `state` as step-N of `folder` (every rank takes part), written under another name, in a
    folder the writer has just made (staging.py: never through a link planted in `folder`), and
    renamed by the writer once DCP has finished (its .metadata last): a save cut short is never
    taken for a checkpoint. A save the disk cannot hold is refused before anything is written
    (space.py); one that fails leaves no step-N.saving behind. Beside the tensors, the record of
    `model` and, of a training checkpoint, `training` (how its job trained, what an export takes:
    model_record.py); `also` writes more into the folder once it is complete (the weights in
    Hugging Face's format), staged the same way: one that fails removes what it wrote, never the
    checkpoint."""
    partial, done = saving_dir(folder, step), step_dir(folder, step)
    _on_writer(is_writer, functools.partial(make_fresh, partial))
    try:
        ignore_unavoidable_warnings()  # DCP's in a process alone (a seed checkpoint)
        dcp.save(state, checkpoint_id=str(partial), planner=SpaceCheckingPlanner(folder))
        if is_writer:
            write_model_record(partial, model, "dataloader" in state, training)
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        # DCP fails a save on every rank once all have stopped writing: the writer removes what they
        # wrote, which nothing would ever read and which would only fill the disk.
        if is_writer:
            remove_ours(partial)
        short = unwrapped(err, NotEnoughSpaceError)
        if short is not None and short is not err:
            raise short from err  # its one line, not DCP's per-rank report
        raise
    export = exporting_dir(folder, step)
    _on_writer(is_writer, functools.partial(_complete, partial, done, export if also else None))
    if also:
        _export_beside(also, export, done, is_writer)


def _on_writer(is_writer: bool, work: Callable[[], None]) -> None:
    """`work` done by the writer (rank 0) while the other ranks wait; its refusal raised on every
    rank alike (a rank that went on would wait in DCP's collectives for a writer that stopped)."""
    refusal = None
    if is_writer:
        try:
            work()
        except (OSError, ValueError) as err:
            refusal = str(err)
    if dist.is_initialized():
        said = [refusal]
        dist.broadcast_object_list(said, src=0)
        refusal = said[0]
    if refusal is not None:
        raise ValueError(refusal)


def _complete(partial: Path, done: Path, export: Path | None) -> None:
    """step-N.saving renamed step-N (a step saved again, by a job that resumed and stopped there,
    replaced); and where an export follows, its own fresh folder."""
    try:
        if done.is_symlink() or done.exists() and not done.is_dir():
            raise ValueError(f"{done} is no step folder a save wrote (a link or a file); remove it")
        if done.exists():
            shutil.rmtree(done)
        os.replace(partial, done)
    except BaseException:
        remove_ours(partial)
        raise
    os.unlink(done / MARK)
    if export is not None:
        make_fresh(export)


def _export_beside(also: Callable[[Path], None], export: Path, done: Path, is_writer: bool) -> None:
    """`also` written into `export` and moved into the complete step folder `done`; one that fails
    (a full disk) removes what it wrote, and the checkpoint stays as it is."""
    try:
        also(export)
    except (Exception, CheckpointException):  # DCP's is a BaseException
        if is_writer:
            remove_ours(export)
        raise
    if not is_writer:
        return
    written = [entry for entry in export.iterdir() if entry.name != MARK]
    if clash := [entry.name for entry in written if os.path.lexists(done / entry.name)]:
        remove_ours(export)  # the checkpoint's own files are never replaced
        raise FileExistsError(f"the Hugging Face export wrote {', '.join(clash)}, which {done} holds already")
    for entry in written:
        os.rename(entry, done / entry.name)
    remove_ours(export)


def save_model(model: torch.nn.Module, folder: str, cfg: ModelConfig) -> Path:
    """Weights only, keyed by the unwrapped parameter names, as step-0 (a seed checkpoint)."""
    save_whole(get_model_state_dict(model), folder, 0, cfg, is_writer=True)
    return step_dir(folder, 0)


def load_model(model: torch.nn.Module, path: str) -> None:
    """The weights of a checkpoint: a seed checkpoint, or a training one (its optimizer state and
    step left out). Read without running code from it (trusted.py): it may come from anyone."""
    reader = open_checkpoint(path)
    # Saved by TrainCheckpointer: model, optimizer, ... under their names.
    training = any(key.startswith("model.") for key in reader.metadata.state_dict_metadata)
    state = get_model_state_dict(model)
    load_trusted({"model": state} if training else state, reader)
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
        optimizers: Optimizers,
        model: ModelConfig,
        training: TrainingRecord,
        data: BatchLoader | None = None,
    ):
        """`model`: the model's config, for the last save in Hugging Face's format; `training`: how
        the job trains and what that export takes beside its weights, recorded with each save (a
        resume goes on with its batch, `titan_exp export` with its sources); `data`: a streamed data
        source, whose position is saved and resumed with the rest."""
        self.cfg, self.parts, self.model, self.training = cfg, parts, model, training
        self.optimizers, self.schedulers = optimizers.optimizers, optimizers.schedulers
        # This job's optimizer.lr, which a resume keeps (the saved scheduler state holds the saved job's).
        self.base_lrs = [list(scheduler.base_lrs) for scheduler in self.schedulers]
        self.data = data
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
        state = {
            "model": model,
            "optimizer": optimizer,
            "lr_scheduler": self.schedulers[0].state_dict(),
            "step": torch.tensor(step),
        }
        if self.data is not None:  # the same on every rank: each reads the whole stream
            state["dataloader"] = self.data.state_after(step)
        return state

    def resume(self) -> int:
        """Load the newest readable checkpoint of cfg.folder; returns its step (0 when there is
        none). One that cannot be read (a file cut short) is passed over, with a warning, for the
        one before; if none can be read, the first failure is raised. One that holds more than DCP
        writes (code to run when read) stops the run."""
        steps = complete_steps(self.cfg.folder) if self.cfg.enable else []
        failures = []
        for step in reversed(steps):
            try:
                return self._load(step)
            except UntrustedCheckpointError:
                raise  # a planted payload, not a file cut short: never passed over for an older one
            except (Exception, CheckpointException) as err:  # DCP's is a BaseException
                failures.append(err)
                why = last_line(str(err) or type(err).__name__)
                print(f"titan_exp: {step_dir(self.cfg.folder, step)} cannot be read ({why})", flush=True)
        if failures:
            raise failures[0]
        return 0

    def _load(self, step: int) -> int:
        reader = open_checkpoint(str(step_dir(self.cfg.folder, step)))
        part_states = self._part_states()
        state = self._merged(part_states, 0)
        load_trusted(state, reader)
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
        for scheduler, ours in zip(self.schedulers, self.base_lrs):
            scheduler.load_state_dict(state["lr_scheduler"])
            follow_this_schedule(scheduler, ours)
        if self.data is not None:
            self.data.resume(state["dataloader"])
        return int(state["step"])

    def maybe_save(self, step: int, last_step: int, is_writer: bool) -> bool:
        """Save every cfg.interval steps and at the last step; returns whether it saved."""
        if not self.cfg.enable or (step % self.cfg.interval and step != last_step):
            return False
        self.save(step, is_writer, last=step == last_step)
        return True

    def save(self, step: int, is_writer: bool, last: bool = False) -> None:
        """Save `step` now (every rank takes part); `is_writer` prunes old step folders. The `last`
        step's weights go into its folder in Hugging Face's format too with checkpoint.last_save_in_hf."""
        export = last and self.cfg.last_save_in_hf
        also = None
        if export:
            also = functools.partial(
                save_hf,
                self.parts,
                cfg=self.model,
                is_writer=is_writer,
                dtype=getattr(torch, self.cfg.export_dtype),
                sources=self.training.sources,
            )
        state = self._merged(self._part_states(), step)
        save_whole(state, self.cfg.folder, step, self.model, is_writer, also, self.training)
        if is_writer and self.cfg.keep_latest_k > 0:
            for old in complete_steps(self.cfg.folder)[: -self.cfg.keep_latest_k]:
                shutil.rmtree(step_dir(self.cfg.folder, old), ignore_errors=True)

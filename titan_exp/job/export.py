"""`titan_exp export STEP_FOLDER --out DIR [--dtype bfloat16] [--tokenizer FILE]`: a checkpoint
already written (`<checkpoint.folder>/step-N`, saved by any layout) as a Hugging Face folder, the
same one `checkpoint.last_save_in_hf` writes at the end of a run: the weights, the config.json that
keeps the original's fields, its generation config and the tokenizer's files (hf_export.py).
What is wrong with the command is refused in one line before torch loads (not a checkpoint, a
model not written in that format, a folder that exists); the folder appears whole or not at all.
torchtitan ships the same as a conversion script."""

import argparse
import glob
import os
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf

from launchers.processes import process_alive
from titan_exp.checkpoint.config import CheckpointConfig
from titan_exp.checkpoint.hf_export import ExportSources
from titan_exp.checkpoint.layout import DCP_METADATA, SAVING_SUFFIX, step_dir
from titan_exp.checkpoint.model_record import MODEL_FILE, export_sources, saved_model
from titan_exp.job.outcome import EXIT_BAD_CONFIG
from titan_exp.job.preflight import check_tokenizer
from titan_exp.models.config import ModelConfig
from titan_exp.models.registry import FAMILIES
from titan_exp.rules import ConfigError, choices

# An export is written into a hidden folder beside --out named this and its process id, then renamed.
_EXPORTING = ".exporting-"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="titan_exp export", description=__doc__.split("\n\n")[0])
    parser.add_argument("step", type=Path, help="a checkpoint's step folder: <checkpoint.folder>/step-N")
    parser.add_argument("--out", type=Path, required=True, help="the Hugging Face folder to write (must not exist)")
    parser.add_argument(
        "--dtype", default="float32", choices=choices(CheckpointConfig, "export_dtype"), help="the weights' dtype"
    )
    parser.add_argument("--tokenizer", help="the tokenizer.json to put beside them (default: the run's, if there)")
    args = parser.parse_args(argv)
    try:
        cfg, sources = _checked(args)
    except ConfigError as err:
        print(f"titan_exp export: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    _export(args.step, args.out, cfg, args.dtype, sources)
    print(f"titan_exp export: {args.out} ({args.dtype}) from {args.step}", flush=True)
    return 0


def _checked(args: argparse.Namespace) -> tuple[ModelConfig, ExportSources]:
    """The model the step folder holds and what goes beside its weights; refused in one line."""
    step = args.step
    if not (step / DCP_METADATA).is_file() or step.name.endswith(SAVING_SUFFIX):
        where = step_dir("<checkpoint.folder>", "N")
        raise ConfigError("STEP_FOLDER", str(step), f"is not a checkpoint (no {DCP_METADATA}); point it at {where}")
    saved = saved_model(step, "STEP_FOLDER")
    if saved is None:
        raise ConfigError("STEP_FOLDER", str(step), f"has no {MODEL_FILE}, which says which model it holds")
    cfg = _model_of(saved, step)
    if args.out.exists() or args.out.is_symlink():
        raise ConfigError("--out", str(args.out), "exists; name a new folder (nothing is written over)")
    if not args.out.absolute().parent.is_dir() or not os.access(args.out.absolute().parent, os.W_OK):
        raise ConfigError("--out", str(args.out), "lies in no folder this user may write in; name another")
    sources = export_sources(step, "STEP_FOLDER")
    if args.tokenizer is not None:
        check_tokenizer("--tokenizer", args.tokenizer, cfg.vocab_size, "give the tokenizer the model was trained on")
        sources = ExportSources(sources.model_folder, str(Path(args.tokenizer).resolve()))
    elif sources.tokenizer is not None and not Path(sources.tokenizer).is_file():
        _say(f"the run's tokenizer {sources.tokenizer} is gone: none is written (--tokenizer gives one)")
        sources = ExportSources(sources.model_folder, None)
    if sources.model_folder is not None and not Path(sources.model_folder).is_dir():
        _say(f"{sources.model_folder}, where the model came from, is gone: its config.json is not kept")
        sources = ExportSources(None, sources.tokenizer)
    return cfg, sources


def _say(line: str) -> None:
    print(f"titan_exp export: {line}", file=sys.stderr, flush=True)


def _model_of(saved: dict, step: Path) -> ModelConfig:
    """The family's model section of a record's, checked as a job's is; one Hugging Face's format
    cannot hold is refused."""
    family = FAMILIES.get(saved.get("name"))
    if family is None or family.hf is None:
        written = ", ".join(name for name, f in FAMILIES.items() if f.hf)
        why = f"holds a {saved.get('name')} model; Hugging Face's format is written of {written} models"
        raise ConfigError("STEP_FOLDER", str(step), why)
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(family.config), saved))
    except Exception as err:  # OmegaConf's: a key or a value the section does not take
        why = " ".join(str(err).split())
        raise ConfigError("STEP_FOLDER", str(step), f"its {MODEL_FILE} is not a {family.name} model ({why})") from None
    cfg.check("model")
    if why := family.hf.refusal(cfg):
        raise ConfigError("STEP_FOLDER", str(step), f"Hugging Face's format cannot hold its model: {why}")
    return cfg


def _export(step: Path, out: Path, cfg: ModelConfig, dtype: str, sources: ExportSources) -> None:
    """The whole model in this process (in `dtype`: the checkpoint's float32 weights cast as read),
    written beside `out` and renamed to it once complete."""
    import torch  # the conversion's own work: the refusals above need none

    from titan_exp.checkpoint.hf import save_hf
    from titan_exp.checkpoint.manager import load_model
    from titan_exp.models.registry import build_model

    with torch.device("meta"):
        model = build_model(cfg).to(getattr(torch, dtype))
    model.to_empty(device="cpu")
    load_model(model, str(step))
    partial = out.with_name(f".{out.name}{_EXPORTING}{os.getpid()}")
    for stale in out.parent.glob(f".{glob.escape(out.name)}{_EXPORTING}*"):  # of an export killed outright
        pid = stale.name.rpartition("-")[2]
        if not (pid.isdigit() and process_alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)
    try:
        save_hf([model], partial, cfg, True, getattr(torch, dtype), sources)
        os.rename(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)

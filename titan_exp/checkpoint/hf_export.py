"""What an export in Hugging Face's format holds beside its weights (checkpoint/hf.py writes those):
the config.json transformers opens the model with, its generation config and the tokenizer's files.
A model that came from a Hugging Face folder keeps that folder's config.json but for the fields the
run changed (the weights' dtype, a key set beside model=hf), and its generation_config.json as it
was: `generate()` stops where the original stops. A model built from a flavor gets a complete
config, its special tokens' ids from the run's tokenizer. Torch-free: `titan_exp export` refuses a
folder it cannot write before it loads torch."""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from titan_exp.data.tokenizer import load_tokenizer
from titan_exp.models.config import ModelConfig
from titan_exp.models.hf import CONFIG_FILE
from titan_exp.models.registry import config_from_hf, family_of
from titan_exp.rules import ConfigError
from titan_exp.untrusted import read_json

GENERATION_CONFIG_FILE = "generation_config.json"
# A tokenizer's files as transformers writes them beside a model (the vocabulary in one of its
# forms, the special tokens, the chat template); what is there is copied.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# transformers writes the weights' dtype under both names (torch_dtype before version 5).
_DTYPE_KEYS = ("dtype", "torch_dtype")


@dataclass(frozen=True)
class ExportSources:
    """Where an export of a run's model takes what goes beside its weights: `model_folder`, the
    Hugging Face folder the model came from (model=hf's, or the one its weights were loaded from;
    None: built from a flavor), and `tokenizer`, the tokenizer.json whose ids the run trained on
    (None: synthetic tokens)."""

    model_folder: str | None
    tokenizer: str | None


def write_beside_weights(folder: Path, cfg: ModelConfig, dtype: str, sources: ExportSources) -> list[str]:
    """config.json, generation_config.json and the tokenizer's files into `folder`, where the
    weights of `cfg`'s model lie in `dtype`; returns what could not be taken from the sources, one
    line each (a source folder gone or changed since the run read it: the export is complete without it)."""
    notes: list[str] = []
    original = _original_config(sources.model_folder, notes)
    ours = family_of(cfg).hf.hf_config(cfg, dtype)
    if original is None:
        config, generation = ours | _token_ids(sources.tokenizer, notes), None
    else:
        as_read = family_of(cfg).hf.hf_config(original[1], _dtype_of(original[0]))
        config = _merged(original[0], _changes(ours, as_read))
        generation = Path(sources.model_folder) / GENERATION_CONFIG_FILE
    _write_json(folder / CONFIG_FILE, config)
    if generation is not None and generation.is_file():
        shutil.copyfile(generation, folder / GENERATION_CONFIG_FILE)
    elif original is None and (ids := {k: v for k, v in config.items() if k.endswith("_token_id") and v is not None}):
        _write_json(folder / GENERATION_CONFIG_FILE, ids)
    _copy_tokenizer(sources, folder)
    return notes


def _original_config(model_folder: str | None, notes: list[str]) -> tuple[dict, ModelConfig] | None:
    """The model folder's config.json and our reading of it, or None (no folder; one that can no
    longer be read is said in `notes`)."""
    if model_folder is None:
        return None
    try:
        return read_json(Path(model_folder) / CONFIG_FILE), config_from_hf(model_folder, "model.hf_path")
    except (ConfigError, ValueError) as err:  # ConfigError is a ValueError; so are read_json's refusals
        notes.append(f"the config.json of {model_folder} is not kept ({err}); written from the model")
        return None


def _dtype_of(config: dict) -> str | None:
    return next((config[key] for key in _DTYPE_KEYS if isinstance(config.get(key), str)), None)


def _changes(now: dict, before: dict) -> dict:
    """The entries of `now` that differ from `before`'s (within nested tables, the differing ones)."""
    changed = {}
    for key, value in now.items():
        if isinstance(value, dict) and isinstance(before.get(key), dict):
            if inner := _changes(value, before[key]):
                changed[key] = inner
        elif key not in before or before[key] != value:
            changed[key] = value
    return changed


def _merged(base: dict, changes: dict) -> dict:
    merged = dict(base)
    for key, value in changes.items():
        nested = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = _merged(base[key], value) if nested else value
    return merged


def _token_ids(tokenizer: str | None, notes: list[str]) -> dict[str, int | None]:
    """The special tokens' ids of the run's tokenizer, as config.json names them."""
    if tokenizer is None:
        return {}
    try:
        found = load_tokenizer(tokenizer)
    except ValueError as err:
        notes.append(f"no token ids from {tokenizer} ({err})")
        return {}
    pad = _named_token(tokenizer, "pad_token")
    ids = {"bos_token_id": found.bos, "eos_token_id": found.eos}
    return ids | ({"pad_token_id": found.tokenizer.token_to_id(pad)} if pad else {})


def _named_token(tokenizer: str, key: str) -> str | None:
    """The text of token `key` in the tokenizer_config.json beside `tokenizer` (None: not named)."""
    config = Path(tokenizer).with_name("tokenizer_config.json")
    values = read_json(config) if config.is_file() else {}
    token = values.get(key) if isinstance(values, dict) else None
    text = token.get("content") if isinstance(token, dict) else token
    return text if isinstance(text, str) else None


def _copy_tokenizer(sources: ExportSources, folder: Path) -> None:
    """The run's tokenizer (its tokenizer.json and the files beside it), else the model folder's."""
    if sources.tokenizer is not None:
        tokenizer = Path(sources.tokenizer)
        shutil.copyfile(tokenizer, folder / "tokenizer.json")
        beside = tokenizer.parent
    elif sources.model_folder is not None:
        beside = Path(sources.model_folder)
    else:
        return
    for name in TOKENIZER_FILES[1:] if sources.tokenizer else TOKENIZER_FILES:
        if (companion := beside / name).is_file():
            shutil.copyfile(companion, folder / name)
    if sources.tokenizer is not None and not (folder / "tokenizer_config.json").exists():
        _write_tokenizer_config(sources.tokenizer, folder)


def _write_tokenizer_config(tokenizer: str, folder: Path) -> None:
    """What AutoTokenizer needs beside a bare tokenizer.json (data=text's trained one): its class
    and the tokens that open and close a document."""
    found = load_tokenizer(tokenizer)
    names = {"bos_token": found.bos, "eos_token": found.eos}
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    config |= {key: found.tokenizer.id_to_token(i) for key, i in names.items() if i is not None}
    _write_json(folder / "tokenizer_config.json", config)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")

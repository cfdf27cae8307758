"""What an export in Hugging Face's format holds beside its weights (checkpoint/hf.py writes those):
the config.json transformers opens the model with, its generation config and the tokenizer's files.
A model that came from a Hugging Face folder keeps that folder's config.json but for the fields the
run changed (the weights' dtype, a key set beside model=hf), and its generation_config.json as it
was: `generate()` stops where the original stops. A model built from a flavor, or trained on
another tokenizer than its folder's, gets its special tokens' ids from the run's tokenizer.
Torch-free: `titan_exp export` refuses what it cannot write before it loads torch."""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from titan_exp.checkpoint.staging import open_new
from titan_exp.data.tokenizer import MAX_TOKENIZER_BYTES, load_tokenizer, named_tokens
from titan_exp.models.config import ModelConfig
from titan_exp.models.hf import CONFIG_FILE, DTYPE_KEYS
from titan_exp.models.registry import config_from_hf, family_of
from titan_exp.untrusted import read_json, regular_file

GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# What transformers writes beside a tokenizer.json (the special tokens, the chat template) or
# instead of it (a vocabulary in another form); what is there is copied.
TOKENIZER_COMPANIONS = (
    TOKENIZER_CONFIG_FILE,
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# The special tokens whose ids config.json and generation_config.json hold.
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


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
    weights of `cfg`'s model lie in `dtype`; returns what was not taken as it was, one line each (a
    source gone or changed since the run read it, another tokenizer: the export is complete without it)."""
    notes: list[str] = []
    original = _original_config(sources.model_folder, notes)
    ours = family_of(cfg).hf.hf_config(cfg, dtype)
    own_tokenizer = sources.tokenizer is None or _is_the_folders(sources)
    ids = {} if original is not None and own_tokenizer else _token_ids(sources.tokenizer, notes)
    if original is not None and ids:
        notes.append(f"trained on {sources.tokenizer}, not the tokenizer of {sources.model_folder}: its token ids")
    if original is None:
        config, generation = ours | ids, None
    else:
        config_json, model = original
        config = _kept(config_json, ours, family_of(cfg).hf.hf_config(model, _dtype_of(config_json))) | ids
        generation = _generation_config(Path(sources.model_folder), notes)
    _write_json(folder / CONFIG_FILE, config)
    generation = (generation or {}) | {key: value for key, value in ids.items() if value is not None}
    if generation:
        _write_json(folder / GENERATION_CONFIG_FILE, generation)
    _copy_tokenizer(sources, folder, notes)
    return notes


def _original_config(model_folder: str | None, notes: list[str]) -> tuple[dict, ModelConfig] | None:
    """The model folder's config.json and our reading of it, or None (no folder; one that can no
    longer be read is said in `notes`)."""
    if model_folder is None:
        return None
    try:
        return read_json(Path(model_folder) / CONFIG_FILE), config_from_hf(model_folder, "model.hf_path")
    except ValueError as err:  # read_json's refusals, and ConfigError
        notes.append(f"the config.json of {model_folder} is not kept ({err}); written from the model")
        return None


def _dtype_of(config: dict) -> str | None:
    return next((config[key] for key in DTYPE_KEYS if isinstance(config.get(key), str)), None)


def _kept(original: dict, ours: dict, as_read: dict) -> dict:
    """`original` (a config.json's table) but for what the run changed: where our writing of the
    run's model (`ours`) differs from our writing of the original as we read it (`as_read`), ours,
    a key ours no longer writes dropped. What we do not read (a key of neither) stays as it was."""
    kept = dict(original)
    for key in {*ours, *as_read}:
        if ours.get(key) == as_read.get(key):
            continue  # the run left it as read: the original's own spelling stays
        if key not in ours:
            kept.pop(key, None)
        elif all(isinstance(table.get(key), dict) for table in (original, ours, as_read)):
            kept[key] = _kept(original[key], ours[key], as_read[key])
        else:
            kept[key] = ours[key]
    return kept


def _generation_config(model_folder: Path, notes: list[str]) -> dict | None:
    """The model folder's generation_config.json (None: it has none, or one that cannot be read)."""
    path = model_folder / GENERATION_CONFIG_FILE
    if not path.exists():
        return None
    try:
        config = read_json(path)
    except ValueError as err:
        notes.append(f"{path} is not kept ({err})")
        return None
    return config if isinstance(config, dict) else None


def _is_the_folders(sources: ExportSources) -> bool:
    """Whether the run's tokenizer is its model folder's own: the same tokenizer.json and
    tokenizer_config.json (which names its special tokens), byte for byte."""
    if sources.model_folder is None:
        return False
    tokenizer, folder = Path(sources.tokenizer), Path(sources.model_folder)
    theirs = _bytes(folder / TOKENIZER_FILE)
    named = _bytes(tokenizer.with_name(TOKENIZER_CONFIG_FILE)) == _bytes(folder / TOKENIZER_CONFIG_FILE)
    return theirs is not None and theirs == _bytes(tokenizer) and named


def _bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None


def _token_ids(tokenizer: str | None, notes: list[str]) -> dict[str, int | None]:
    """The special tokens' ids of the run's tokenizer, as config.json names them."""
    if tokenizer is None:
        return {}
    try:
        found, (pad,) = load_tokenizer(tokenizer), named_tokens(Path(tokenizer), "pad_token")
    except ValueError as err:
        notes.append(f"no token ids from {tokenizer} ({err})")
        return {}
    ids = dict(zip(_TOKEN_IDS, (found.bos, found.eos)))
    return ids | ({"pad_token_id": found.tokenizer.token_to_id(pad)} if pad else {})


def _copy_tokenizer(sources: ExportSources, folder: Path, notes: list[str]) -> None:
    """The run's tokenizer (its tokenizer.json and the files beside it), else the model folder's."""
    if sources.tokenizer is not None:
        _copy(Path(sources.tokenizer), folder / TOKENIZER_FILE, notes)
        beside = Path(sources.tokenizer).parent
    elif sources.model_folder is not None:
        _copy(Path(sources.model_folder) / TOKENIZER_FILE, folder / TOKENIZER_FILE, notes)
        beside = Path(sources.model_folder)
    else:
        return
    for name in TOKENIZER_COMPANIONS:
        _copy(beside / name, folder / name, notes)
    if sources.tokenizer is not None and not (folder / TOKENIZER_CONFIG_FILE).exists():
        _write_tokenizer_config(sources.tokenizer, folder)


def _copy(source: Path, target: Path, notes: list[str]) -> None:
    """`source`, where it is a file of a tokenizer's size (a JSON one holding JSON): a folder's
    file of that name that is anything else (a link to a secret, a FIFO) is named, not copied."""
    if not source.exists() and not source.is_symlink():
        return
    try:
        if (size := regular_file(source)) > MAX_TOKENIZER_BYTES:
            raise ValueError(f"{size:,} bytes, more than a tokenizer's file may be")
        if source.suffix == ".json":
            read_json(source, MAX_TOKENIZER_BYTES)
    except ValueError as err:
        notes.append(f"{source} is not copied ({err})")
        return
    with open(source, "rb") as read, open_new(target) as written:
        shutil.copyfileobj(read, written)


def _write_tokenizer_config(tokenizer: str, folder: Path) -> None:
    """What AutoTokenizer needs beside a bare tokenizer.json (data=text's trained one): its class
    and the tokens that open and close a document."""
    found = load_tokenizer(tokenizer)
    names = {"bos_token": found.bos, "eos_token": found.eos}
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    config |= {key: found.tokenizer.id_to_token(i) for key, i in names.items() if i is not None}
    _write_json(folder / TOKENIZER_CONFIG_FILE, config)


def _write_json(path: Path, value: dict) -> None:
    with open_new(path) as file:  # a new file, never written through a link
        file.write((json.dumps(value, indent=2) + "\n").encode())

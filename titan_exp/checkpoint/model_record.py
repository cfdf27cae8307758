"""Which model a checkpoint holds, in a file beside its tensors: step-N/model.json, the model section of
the job that saved it. A job that resumes from a checkpoint or loads its weights is checked against
it before any rank starts, naming the first key that differs (a rank would only fail later, with
a size mismatch deep in DCP). A training checkpoint's record also says how its job trained
(TrainedAs): the batch a resume goes on with, the schedule it changes (job/resume.py). JSON, not
DCP's pickled .metadata: the launching process neither imports torch nor unpickles what a folder
holds. Torch-free."""

import dataclasses
import json
from pathlib import Path

from titan_exp.checkpoint.hf_export import ExportSources
from titan_exp.checkpoint.staging import open_new, open_own
from titan_exp.models.config import ModelConfig
from titan_exp.optim.config import LRSchedulerConfig
from titan_exp.rules import ConfigError, check_positive, dotted_keys

MODEL_FILE = "model.json"
# Keys that change no tensor of the checkpoint: labels, the longest sequence (the rotary table is
# rebuilt, not saved), the rotary embedding's and norms' constants (a long-context run goes on
# from a short one's weights) and the attention mask.
NOT_WEIGHTS = ("name", "flavor", "hf_path", "max_seq_len", "norm_eps", "rope_", "attn_mask_type")
# Larger than any model section: a file beyond it is not one of ours.
_MAX_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class TrainedAs:
    """How the job that saved a training checkpoint trained: its tokens per optimizer step (global
    batch × seq_len), its training.steps and its learning rate's schedule (optimizer.lr, lr_scheduler)."""

    tokens_per_step: int
    steps: int
    lr: float
    lr_scheduler: LRSchedulerConfig


@dataclasses.dataclass(frozen=True)
class TrainingRecord:
    """What a training checkpoint records beside its model: how its job trained, and what an export
    of it takes beside its weights (`titan_exp export` reads them)."""

    trained_as: TrainedAs
    sources: ExportSources


def write_model_record(
    step_folder: Path, model: ModelConfig, data_position: bool, training: TrainingRecord | None = None
) -> None:
    """`data_position`: the checkpoint holds where a streamed data source stood (data=files);
    `training`: a training checkpoint's (None: a seed checkpoint, weights alone)."""
    record = {"model": dataclasses.asdict(model), "data_position": data_position}
    if training is not None:
        record["training"] = dataclasses.asdict(training.trained_as)
        record["export"] = dataclasses.asdict(training.sources)
    with open_new(step_folder / MODEL_FILE) as file:
        file.write(json.dumps(record, indent=1).encode())


def saved_model(step_folder: Path, key: str) -> dict | None:
    """The model section the checkpoint in `step_folder` holds, as its record says (None: it has no
    record); `key` named the folder (a refusal of its record names it)."""
    return _record(step_folder, key).get("model")


def export_sources(step_folder: Path, key: str) -> ExportSources:
    """What the run that saved `step_folder` would put beside its weights in an export; where its
    record does not say (saved before records said it, or a seed checkpoint), the Hugging Face
    folder its model section names (model=hf's), no tokenizer."""
    record = _record(step_folder, key)
    model_folder = record.get("model", {}).get("hf_path")
    saved = record.get("export", {"model_folder": model_folder if isinstance(model_folder, str) else None})
    fields = [f.name for f in dataclasses.fields(ExportSources)]
    if (
        not isinstance(saved, dict)
        or set(saved) - set(fields)
        or not all(saved.get(name) is None or isinstance(saved[name], str) for name in fields)
    ):
        raise _unreadable(step_folder, key, ValueError("its export entry names no folder or file"))
    return ExportSources(**{name: saved.get(name) for name in fields})


def trained_as(step_folder: Path) -> TrainedAs | None:
    """How the job that saved `step_folder` trained (None: its record does not say: a seed
    checkpoint, or one saved before records said it). A record from someone else that says it in
    other keys or values is refused."""
    saved = _record(step_folder, "checkpoint.folder").get("training")
    if saved is None:
        return None
    counts = ("tokens_per_step", "steps")
    try:
        if not isinstance(saved, dict) or set(saved) != {*counts, "lr", "lr_scheduler"}:
            raise ValueError("its training entry has other keys")
        if not all(type(saved[key]) is int and saved[key] > 0 for key in counts):  # not a bool, nor a float
            raise ValueError("its training entry counts no steps or tokens")
        schedule = LRSchedulerConfig(**saved["lr_scheduler"])  # TypeError: other keys, or no mapping
        schedule.check("lr_scheduler")
        check_positive("optimizer.lr", saved["lr"])
    except (TypeError, ValueError) as err:  # ConfigError is a ValueError
        raise _unreadable(step_folder, "checkpoint.folder", err) from None
    return TrainedAs(saved["tokens_per_step"], saved["steps"], saved["lr"], schedule)


def check_data_position(step_folder: Path, needed: bool) -> None:
    """A resume whose data source reads on from a saved position (data=files) from a checkpoint
    that holds none (saved by a data=text or synthetic run) is refused: its ranks would fail
    looking for it. A checkpoint without the record is not checked."""
    saved = _record(step_folder, "checkpoint.folder").get("data_position", needed)
    if needed and not saved:
        raise ConfigError(
            "data.source",
            "files",
            f"the checkpoint in {step_folder} was saved by a run of another data source, which kept no "
            "position in your documents; resume with that source, or point checkpoint.folder elsewhere "
            "(checkpoint.initial_load_path takes its weights alone)",
        )


def _record(step_folder: Path, key: str) -> dict:
    """The step folder's record ({} where it has none); one that is a link, a FIFO or a device is
    refused, never opened through the link nor waited on."""
    record = step_folder / MODEL_FILE
    if not record.exists() and not record.is_symlink():
        return {}
    try:
        with open_own(record) as file:
            text = file.read(_MAX_BYTES + 1)
        if len(text) > _MAX_BYTES:
            raise ValueError(f"larger than {_MAX_BYTES} bytes")
        saved = json.loads(text)
        if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
            raise ValueError("no model section")
        return saved
    except (OSError, ValueError, RecursionError) as err:
        raise _unreadable(step_folder, key, err) from None


def _unreadable(step_folder: Path, key: str, err: Exception) -> ConfigError:
    return ConfigError(key, str(step_folder), f"its {MODEL_FILE} cannot be read ({err}); point {key} elsewhere")


def check_same_model(step_folder: Path, model: ModelConfig, key: str) -> None:
    """Refuse a checkpoint whose model differs from `model` in a key that shapes its tensors (`key`:
    the config key that led to it), or that does not say which model it holds: DCP would load the
    tensors whose names match into another model and leave the rest as initialized."""
    record = _record(step_folder, key)
    if not record:
        raise ConfigError(
            key,
            str(step_folder),
            f"has no {MODEL_FILE}, which says which model it holds (every save writes one); "
            f"point {key} at a checkpoint this project saved",
        )
    theirs = record["model"]
    ours = dotted_keys(json.loads(json.dumps(dataclasses.asdict(model))))  # tuples as the record holds them
    saved = dotted_keys(theirs)
    if saved.get("name") != ours["name"]:
        raise ConfigError(
            key, str(step_folder), f"holds a {saved.get('name')} model, not {ours['name']}; point {key} elsewhere"
        )
    for name in [*ours, *(name for name in saved if name not in ours)]:
        if name.startswith(NOT_WEIGHTS) or ours.get(name) == saved.get(name):
            continue
        raise ConfigError(
            f"model.{name}",
            ours.get(name),
            f"the checkpoint in {step_folder} has {saved.get(name)}; train that model (model.{name}={saved.get(name)}) "
            f"or point {key} elsewhere",
        )

"""`titan_exp --help`: the project's own page (Hydra's stays under --hydra-help): the subcommands,
the config groups with their options, the most used keys with one line each, and where to read
more. A key's line is the comment written above its field in its section's dataclass, so it is
written once, next to the code that reads it. Torch-free."""

import dataclasses
import inspect
import re
from collections.abc import Iterable

from omegaconf import OmegaConf

from launchers.registry import LAUNCHERS
from titan_exp.config.compose import compose_job_config
from titan_exp.config.schema import JobConfig
from titan_exp.config.tree import default_options, group_options

# What a newcomer sets first, in the order a run is thought through: what to train, how to split
# it, how long and how big, where it runs, where it is recorded.
MOST_USED = (
    "parallelism.data_parallel_shard_degree",
    "parallelism.data_parallel_replicate_degree",
    "parallelism.tensor_parallel_degree",
    "parallelism.pipeline_parallel_degree",
    "parallelism.pipeline_parallel_schedule",
    "parallelism.context_parallel_degree",
    "activation_checkpoint.mode",
    "compile.enable",
    "training.steps",
    "training.local_batch_size",
    "training.global_batch_size",
    "training.seq_len",
    "training.mixed_precision_param",
    "optimizer.lr",
    "launcher.nproc_per_node",
    "launcher.nodes",
    "launcher.device",
    "checkpoint.enable",
    "checkpoint.initial_load_path",
    "tracking.uri",
    "tracking.experiment",
    "debug.seed",
    "debug.comm_mode",
)


def page(subcommands: dict[str, str]) -> str:
    """The whole page; `subcommands`: each subcommand's one-line summary."""
    sections = [
        f"titan_exp: compose a training run from config groups, place it ({'/'.join(LAUNCHERS)}), train it "
        "with PyTorch-native parallelism and compare layouts in MLflow.",
        _usage(subcommands),
        "Config groups (GROUP=OPTION; * the default):\n" + "\n".join(_groups()),
        "Most used keys (KEY=VALUE; the default, then what it does):\n" + "\n".join(_keys()),
        "More:\n"
        "  titan_exp show [overrides]       the resolved job: mesh, ranks, batch, accumulation, what the ranks get\n"
        "  titan_exp --cfg job [overrides]  every key as composed, before resolution\n"
        "  titan_exp --hydra-help           Hydra's flags (-m, --cfg, --info, -sc install=bash for tab completion)\n"
        "  README.md                        quick start, commands, troubleshooting; docs/ for internals",
    ]
    return "\n\n".join(sections) + "\n"


def _usage(subcommands: dict[str, str]) -> str:
    rows = [
        ("titan_exp [GROUP=OPTION] [KEY=VALUE]...", f"train one job (the default: {_default_job()})"),
        ("titan_exp -m KEY=A,B [GROUP=X,Y]...", "a sweep: one MLflow parent run, a child run per point, compared"),
        *((f"titan_exp {name} ...", summary) for name, summary in subcommands.items()),
        ("titan_exp SUBCOMMAND --help", "a subcommand's own options"),
    ]
    width = max(len(usage) for usage, _ in rows)
    return "Usage:\n" + "\n".join(f"  {usage:<{width}}  {summary}" for usage, summary in rows)


def _default_job() -> str:
    picked = default_options()
    return f"{picked['model']}, {picked['parallelism']} on 2 CPU ranks or every GPU"


def _groups() -> Iterable[str]:
    defaults = default_options()
    for group, options in group_options().items():
        shown = [f"{option}*" if option == defaults.get(group) else option for option in options]
        yield f"  {group:<13} " + " ".join(shown)


def _keys() -> Iterable[str]:
    defaults = _composed_defaults()
    rows = [(key, str(defaults[key.split(".")[0]][key.split(".")[1]])) for key in MOST_USED]
    key_width, value_width = (max(len(row[i]) for row in rows) for i in (0, 1))
    for key, value in rows:
        section, name = key.split(".")
        doc = first_sentence(field_docs(_section_type(section))[name])
        yield f"  {key:<{key_width}}  {value:<{value_width}}  {doc}"


def _composed_defaults() -> dict:
    """The keys' values with config.yaml's default options (what a run without overrides gets)."""
    return OmegaConf.to_container(OmegaConf.structured(compose_job_config([])))


def _section_type(section: str) -> type:
    return next(f.default_factory for f in dataclasses.fields(JobConfig) if f.name == section)


def field_docs(section: type) -> dict[str, str]:
    """Each field's comment: the comment lines just above it, or the one after it on its line."""
    names = {f.name for f in dataclasses.fields(section)}
    docs: dict[str, str] = {}
    for klass in reversed(section.__mro__):  # a subclass's comment wins over its base's
        if not dataclasses.is_dataclass(klass):
            continue
        above: list[str] = []
        for line in inspect.getsource(klass).splitlines()[1:]:
            text = line.strip()
            if text.startswith("#"):
                above.append(text.lstrip("#").strip())
                continue
            field = re.match(r"(\w+)\s*:[^#]*(?:#\s*(.*))?$", text)
            if field and field.group(1) in names:
                docs[field.group(1)] = " ".join(above) or field.group(2) or ""
            above = []
    return docs


def first_sentence(text: str) -> str:
    match = re.match(r"(.+?)\.(\s+[A-Z(]|$)", text)  # not at "e.g. a"
    return match.group(1) if match else text

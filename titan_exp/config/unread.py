"""The keys a layout does not read: logged with every run (so a comparison never takes them for a
difference) and said before a job starts where one is set away from its default. Torch-free."""

from titan_exp.config.schema import JobConfig
from titan_exp.parallel.config import PIPELINE_KEYS
from titan_exp.parallel.dims import ParallelDims


def unread_keys(cfg: JobConfig, dims: ParallelDims) -> list[tuple[str, str]]:
    """(key, why) of each key this layout does not read, whatever its value."""
    ac, data, unquantized = cfg.activation_checkpoint, cfg.data, cfg.quantize.name == "none"
    source = f"data.source is {data.source}"
    tokenizer = f"{source}" if data.source != "text" else "data.tokenizer_path is set"
    validation_files = data.source == "files" and bool(cfg.validation.paths)
    # (section name, its keys, whether they are unread, why)
    unread = [
        ("parallelism", PIPELINE_KEYS, dims.pp == 1, "parallelism.pipeline_parallel_degree is 1"),
        ("parallelism", ("enable_async_tensor_parallel",), dims.tp == 1, "parallelism.tensor_parallel_degree is 1"),
        ("parallelism", ("context_parallel_impl",), dims.cp == 1, "parallelism.context_parallel_degree is 1"),
        ("parallelism", ("fsdp_reshard_after_forward",), not dims.fsdp_enabled, "no dimension is sharded by FSDP"),
        ("activation_checkpoint", ("selective_ac_option",), ac.mode != "selective", f"its mode is {ac.mode}"),
        ("compile", ("backend", "components"), not cfg.compile.enable, "compile.enable is false"),
        ("quantize", ("recipe", "filter_fqns", "enable_fsdp_float8_all_gather"), unquantized, "quantize=none"),
        ("checkpoint", ("interval", "keep_latest_k"), not cfg.checkpoint.enable, "checkpoint.enable is false"),
        ("data", ("corpus_path",), data.source != "text", source),
        ("data", ("tokenizer_vocab_size",), data.source != "text" or data.tokenizer_path is not None, tokenizer),
        ("data", ("synthetic_vocab_size", "synthetic_branching"), data.source != "synthetic", source),
        ("data", ("paths", "text_field"), data.source != "files", source),
        ("validation", ("paths",), data.source != "files" or not cfg.validation.enable, "it is read by data=files"),
        ("validation", ("held_out_fraction",), validation_files, "validation.paths is set"),
    ]
    return [(f"{section}.{name}", why) for section, names, is_unread, why in unread if is_unread for name in names]


def ignored_keys(cfg: JobConfig, dims: ParallelDims) -> list[tuple[str, object, str]]:
    """(key, value, why) of each key set away from its default that this layout does not read."""
    found = []
    for key, why in unread_keys(cfg, dims):
        section_name, name = key.split(".")
        section = getattr(cfg, section_name)
        value = getattr(section, name)
        if value != getattr(type(section)(), name):
            found.append((key, value, why))
    return found

"""torchtitan's key names of today (its 2026 config), accepted beside ours: each is a field declared
with `rules.torchtitan_name` in its section, and here its value becomes ours, before any rule is
checked, so that the rules, the resolved job and the MLflow params speak one set of names. Where the
units differ (torchtitan counts tokens, ours sequences) the value is converted; one that does not
convert exactly, or that contradicts our key set beside it, is refused in one line."""

import dataclasses

from titan_exp.config.schema import JobConfig
from titan_exp.rules import ConfigError

# comm.mode's words for debug.comm_mode's.
COMM_MODES = {"default": "real", "fake_backend": "fake_backend", "local_tensor": "local_tensor"}


def apply_aliases(cfg: JobConfig) -> None:
    """Every torchtitan-named key that was given, written into ours and then cleared (in place)."""
    t, p = cfg.training, cfg.parallelism
    pp_microbatches = p.num_pp_microbatches
    _take(cfg, "training.max_context_length", t.max_context_length)
    microbatch_tokens = t.num_tokens_per_microbatch_per_dp_rank
    if microbatch_tokens is not None:
        # torchtitan's microbatch is one forward: a pipeline microbatch when pipelining.
        sequences = _sequences(cfg, "training.num_tokens_per_microbatch_per_dp_rank", microbatch_tokens)
        if pp_microbatches is not None:
            _take(cfg, "parallelism.num_pp_microbatches", sequences)
            _take(cfg, "training.num_tokens_per_microbatch_per_dp_rank", sequences * pp_microbatches)
        else:
            _take(cfg, "training.num_tokens_per_microbatch_per_dp_rank", sequences)
    elif pp_microbatches is not None:
        if pp_microbatches <= 0 or t.local_batch_size % pp_microbatches:
            raise ConfigError(
                "parallelism.num_pp_microbatches",
                pp_microbatches,
                f"must divide training.local_batch_size={t.local_batch_size} (torchtitan's pipeline microbatches)",
            )
        _take(cfg, "parallelism.num_pp_microbatches", t.local_batch_size // pp_microbatches)
    step_tokens = t.num_tokens_per_train_step
    if step_tokens is not None:
        sequences = -1 if step_tokens == -1 else _sequences(cfg, "training.num_tokens_per_train_step", step_tokens)
        _take(cfg, "training.num_tokens_per_train_step", sequences)
    _take(cfg, "compile.enable_async_tensor_parallel", cfg.compile.enable_async_tensor_parallel)
    mode = cfg.comm.mode
    if mode is not None and mode not in COMM_MODES:
        raise ConfigError("comm.mode", mode, f"choose one of {', '.join(COMM_MODES)} (torchtitan's names)")
    _take(cfg, "comm.mode", COMM_MODES.get(mode))


def _sequences(cfg: JobConfig, key: str, tokens: int) -> int:
    seq_len = cfg.training.seq_len
    if tokens <= 0 or tokens % seq_len:
        raise ConfigError(key, tokens, f"must be a positive multiple of training.seq_len={seq_len} (whole sequences)")
    return tokens // seq_len


def _take(cfg: JobConfig, alias: str, value: object) -> None:
    """Our key (the alias's `alias_of`) set to `value` when the alias was given; the alias cleared."""
    section_name, name = alias.split(".")
    section = getattr(cfg, section_name)
    if getattr(section, name) is None:
        return
    target = next(f.metadata["alias_of"] for f in dataclasses.fields(section) if f.name == name)
    target_section, target_name = target.split(".")
    ours = getattr(cfg, target_section)
    default = getattr(type(ours)(), target_name)
    if getattr(ours, target_name) not in (default, value):
        raise ConfigError(
            alias,
            getattr(section, name),
            f"sets {target}={value} but {target}={getattr(ours, target_name)} is set too; give one of them",
        )
    setattr(ours, target_name, value)
    setattr(section, name, None)

"""The rules across sections, and between the config and where it runs. Each section's own rules
are beside its dataclass (`check`); the checks that touch the disk, the network or the memory
estimate are the pre-flight's (job/preflight.py). Every rule raises ConfigError naming the key, the
offending value and the fix, so the command line prints one line and exits 2."""

from launchers.base import Placement
from titan_exp.config.schema import JobConfig
from titan_exp.config.unread import ignored_keys
from titan_exp.models.registry import FAMILIES, family_of, hf_cautions
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.stages import StagePlan
from titan_exp.rules import ConfigError


def check_job(cfg: JobConfig, dims: ParallelDims, placement: Placement, placed: bool = True) -> None:
    """Every rule across sections, once the degrees and the placement are known (`placed=False`:
    planned, not run; the device's features are then the planned hardware's business)."""
    check_model_fit(cfg, dims)
    check_layout(cfg, dims)
    check_batch(cfg, dims)
    check_against_model(cfg, placed)
    if cfg.checkpoint.create_seed_checkpoint and dims.world_size != 1:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint",
            True,
            f"writes the initial weights from one rank but the world size is {dims.world_size}; add parallelism=single",
        )
    if cfg.debug.comm_mode == "real" and placed:
        check_device_features(cfg, dims, placement.device)
    elif cfg.debug.comm_mode == "local_tensor":
        check_local_tensor_layout(cfg, dims)


def cautions(cfg: JobConfig, dims: ParallelDims) -> list[str]:
    """What a job may run with but is rarely meant (said before it starts; torchtitan warns of the
    same): `cfg` as composed (before resolution fills it in), `dims` as resolved."""
    said = [f"{key}={value} has no effect: {why}" for key, value, why in ignored_keys(cfg, dims)]
    if cfg.model.hf_path is not None:
        said += [f"model.hf_path={cfg.model.hf_path}: {note}" for note in hf_cautions(cfg.model.hf_path)]
    # Only a warmup someone chose: the default's 10 steps outlast every short smoke run, as meant.
    chosen_warmup = cfg.lr_scheduler.warmup_steps != type(cfg.lr_scheduler)().warmup_steps
    if chosen_warmup and cfg.lr_scheduler.warmup_steps > cfg.training.steps:
        said.append(
            f"lr_scheduler.warmup_steps={cfg.lr_scheduler.warmup_steps} exceeds training.steps={cfg.training.steps}: "
            "the learning rate never reaches optimizer.lr"
        )
    return said


def check_model_fit(cfg: JobConfig, dims: ParallelDims) -> None:
    """Degrees that must divide the model's heads, kv-heads and layers, and the sequence."""
    m = cfg.model
    for attr in ("n_heads", "kv_heads"):
        count = getattr(m, attr)
        if count % dims.tp:
            raise ConfigError(
                "parallelism.tensor_parallel_degree",
                dims.tp,
                f"must divide model {attr.replace('kv_heads', 'n_kv_heads')}={count} of {m.name}_{m.flavor}",
            )
    if dims.pp > 1:
        check_pipeline(cfg, dims)
    if dims.cp > 1 and (why := m.context_parallel_refusal):
        raise ConfigError("parallelism.context_parallel_degree", dims.cp, f"{why}; set it to 1")
    if m.attn_mask_type == "block_causal" and dims.cp > 1:
        raise ConfigError(
            "model.attn_mask_type",
            m.attn_mask_type,
            "context parallelism's attention here is causal over the whole sequence, not per document; "
            "set model.attn_mask_type=causal or parallelism.context_parallel_degree=1",
        )
    moe = m.moe
    if dims.pp > 1 and moe.enabled and moe.aux_loss_coeff is not None and moe.aux_loss_over == "all_layers":
        raise ConfigError(
            "model.moe.aux_loss_over",
            moe.aux_loss_over,
            "pools every layer's routing of a microbatch, which no pipeline stage sees whole; "
            "set model.moe.aux_loss_over=each_layer or model.moe.aux_loss_coeff=null",
        )
    cp, seq_len = dims.cp, cfg.training.seq_len
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            "parallelism.context_parallel_degree",
            cp,
            f"2 × it must divide training.seq_len={seq_len} (each rank takes two load-balanced chunks)",
        )
    if (seq_len // cp) % dims.tp:
        where = f"training.seq_len={seq_len}" if cp == 1 else f"each cp rank's {seq_len // cp} tokens"
        raise ConfigError(
            "parallelism.tensor_parallel_degree",
            dims.tp,
            f"must divide {where} (sequence parallelism splits the sequence)",
        )


def check_pipeline(cfg: JobConfig, dims: ParallelDims) -> None:
    p, m, t = cfg.parallelism, cfg.model, cfg.training
    try:
        plan = StagePlan.from_config(p, m.n_layers)
    except ValueError as err:
        key = (
            "pipeline_parallel_layers_per_stage" if p.pipeline_parallel_layers_per_stage else "pipeline_parallel_degree"
        )
        raise ConfigError(f"parallelism.{key}", getattr(p, key), f"{err} (model {m.name}_{m.flavor})") from None
    mb = p.pipeline_parallel_microbatch_size
    if mb <= 0 or t.local_batch_size % mb:
        raise ConfigError(
            "parallelism.pipeline_parallel_microbatch_size",
            mb,
            f"must divide training.local_batch_size={t.local_batch_size}",
        )
    microbatches = t.local_batch_size // mb
    if microbatches < dims.pp:
        raise ConfigError(
            "training.local_batch_size",
            t.local_batch_size,
            f"gives {microbatches} microbatches, fewer than the {dims.pp} pipeline ranks; raise it",
        )
    if p.pipeline_parallel_schedule == "DualPipeV" and microbatches < plan.num_stages:
        raise ConfigError(
            "training.local_batch_size",
            t.local_batch_size,
            f"gives {microbatches} microbatches; DualPipeV needs at least one per stage ({plan.num_stages}); raise it",
        )
    if m.tie_word_embeddings:
        raise ConfigError(
            "parallelism.pipeline_parallel_degree",
            dims.pp,
            f"{m.name}_{m.flavor} ties its embeddings to the output, which sit on different stages",
        )


def check_layout(cfg: JobConfig, dims: ParallelDims) -> None:
    """Combinations of parallelisms, and of a parallelism and another section, that are not wired."""
    p = cfg.parallelism
    if dims.cp > 1 and dims.pp > 1 and p.context_parallel_impl == "torch":
        raise ConfigError(
            "parallelism.context_parallel_impl",
            "torch",
            "torch's ring attention does not combine with pipeline parallelism here; "
            "use parallelism.context_parallel_impl=allgather (or set a degree to 1)",
        )
    if p.enable_async_tensor_parallel:
        if dims.tp == 1:
            raise ConfigError(
                "parallelism.enable_async_tensor_parallel", True, "needs parallelism.tensor_parallel_degree > 1"
            )
        if not cfg.compile.enable:
            raise ConfigError(
                "parallelism.enable_async_tensor_parallel", True, "needs compile.enable=true (it is an inductor pass)"
            )
    model = f"{cfg.model.name}_{cfg.model.flavor}"
    moe_model = cfg.model.moe.enabled
    _check_expert_layout(cfg, dims, model)
    if moe_model and cfg.quantize.name != "none":
        raise ConfigError(
            "quantize",
            cfg.quantize.name,
            f"{model}'s experts are not converted to low precision yet; use quantize=none",
        )
    if cfg.quantize.name == "mxfp8" and dims.tp > 1:
        raise ConfigError(
            "quantize",
            "mxfp8",
            "mxfp8 under tensor parallelism is not wired here; use quantize=float8 or tensor_parallel_degree=1",
        )


def _check_expert_layout(cfg: JobConfig, dims: ParallelDims, model: str) -> None:
    """Expert parallelism against the model and the other degrees (its arithmetic with dp_shard,
    cp and tp is ParallelDims')."""
    key, moe = "parallelism.expert_parallel_degree", cfg.model.moe
    if dims.ep > 1 and not moe.enabled:
        raise ConfigError(key, dims.ep, f"{model} has no experts to split; set it to 1")
    if dims.ep > 1 and moe.num_experts % dims.ep:
        raise ConfigError(key, dims.ep, f"must divide {model}'s {moe.num_experts} experts (model.moe.num_experts)")
    if moe.enabled and moe.hidden_dim % dims.experts_tp:
        # Without expert parallelism the experts' split is TP's (ParallelDims.experts_tp).
        etp_key = "parallelism.expert_tensor_parallel_degree" if dims.ep > 1 else "parallelism.tensor_parallel_degree"
        raise ConfigError(
            etp_key, dims.experts_tp, f"must divide {model}'s expert hidden dim {moe.hidden_dim} (model.moe.hidden_dim)"
        )


def check_batch(cfg: JobConfig, dims: ParallelDims) -> None:
    """global_batch_size -1 or a multiple of what one microstep takes."""
    t = cfg.training
    if t.global_batch_size == -1:
        return
    per_microstep = t.local_batch_size * dims.dp
    if dims.pp > 1 and t.global_batch_size != per_microstep:
        raise ConfigError(
            "training.global_batch_size",
            t.global_batch_size,
            "gradient accumulation and pipeline parallelism do not combine yet; "
            "raise local_batch_size (more microbatches) instead",
        )
    if t.global_batch_size <= 0 or t.global_batch_size % per_microstep:
        raise ConfigError(
            "training.global_batch_size",
            t.global_batch_size,
            f"must be a positive multiple of local_batch_size × data-parallel degree = "
            f"{t.local_batch_size} × {dims.dp} (or -1 for exactly that)",
        )


def check_against_model(cfg: JobConfig, placed: bool = True) -> None:
    """The sequence and the data's vocabulary within the model's; documents for a document mask.
    A plan (`placed=False`) reads no data: the data's rules are a job's."""
    t, m, d = cfg.training, cfg.model, cfg.data
    if m.attn_mask_type == "block_causal" and d.source == "synthetic" and placed:
        raise ConfigError(
            "model.attn_mask_type",
            m.attn_mask_type,
            "synthetic data is one stream, not documents; use data=files or data=text",
        )
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            "training.seq_len", t.seq_len, f"exceeds model max_seq_len={m.max_seq_len} of {m.name}_{m.flavor}; lower it"
        )
    c = cfg.checkpoint
    hf_key = "initial_load_in_hf" if c.initial_load_in_hf else "last_save_in_hf" if c.last_save_in_hf else None
    if hf_key:
        hf = family_of(m).hf
        readable = ", ".join(name for name, family in FAMILIES.items() if family.hf)
        refused = f"only {readable} models are read and written in it here" if hf is None else hf.refusal(m)
        if refused:
            raise ConfigError(
                f"checkpoint.{hf_key}", True, f"Hugging Face's format cannot hold {m.name}_{m.flavor}: {refused}"
            )
    if d.vocab_key is None or not placed:  # a tokenizer file's: the pre-flight reads it
        return
    vocab = getattr(d, d.vocab_key)
    if not 0 < vocab <= m.vocab_size:
        own = "data=files data.paths=[...] data.tokenizer_path=<its tokenizer.json>"
        fix = f"train on the model's own tokens ({own}) or lower it" if d.source == "text" else "lower it"
        within = f"must lie in [1, model vocab_size={m.vocab_size}] of {m.name}_{m.flavor}"
        raise ConfigError(f"data.{d.vocab_key}", vocab, f"{within}; {fix}")


def check_device_features(cfg: JobConfig, dims: ParallelDims, device: str) -> None:
    """Features that exist on CUDA only, refused on a CPU job by name."""
    if device == "cuda":
        return
    p = cfg.parallelism
    if dims.cp > 1 and p.context_parallel_impl == "torch":
        raise ConfigError(
            "parallelism.context_parallel_impl",
            "torch",
            "torch's ring attention needs CUDA (the CPU attention kernel has no context-parallel sharding "
            "strategy); use parallelism.context_parallel_impl=allgather (or auto) on CPU",
        )
    if cfg.quantize.name == "mxfp8":
        raise ConfigError(
            "quantize",
            "mxfp8",
            "needs a Blackwell (compute capability >= 10.0) GPU; use quantize=float8 on this machine",
        )
    if p.enable_async_tensor_parallel:
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel", True, "needs CUDA (symmetric memory); set it to false on CPU"
        )


def check_local_tensor_layout(cfg: JobConfig, dims: ParallelDims) -> None:
    """COMM_MODE=local_tensor runs tensor parallelism only."""
    if max(dims.dp_shard, dims.dp_replicate, dims.pp, dims.cp, dims.ep) > 1:
        raise ConfigError(
            "COMM_MODE",
            "local_tensor",
            "runs tensor parallelism only: torch 2.13's LocalTensorMode fails inside FSDP2 (resize_() on an invalid "
            "storage) and is not wired for DDP/pipelining/CP/EP here; "
            f"use parallelism=tp, or COMM_MODE=fake_backend for {cfg.parallelism.name}",
        )

"""Our Llama 3 flavors said in Hugging Face's words (models/llama3/hf_format.py), held to
`transformers` itself on the meta device: the config.json we write is one LlamaConfig reads as the
same model (the same parameter names, shapes and count), and reading it back gives our fields."""

import dataclasses

import pytest
import torch
import transformers

from titan_exp.config.compose import compose_job_config
from titan_exp.models.config import ModelConfig
from titan_exp.models.hf import refusing
from titan_exp.models.registry import FAMILIES, build_model

LLAMA = FAMILIES["llama3"].hf


def fields_from_hf(hf: dict) -> dict:
    return LLAMA.fields_from_hf(hf, refusing("model.hf_path", "folder"))


FLAVORS = ("llama3_debug", "llama3_1b", "llama3_8b", "llama3_70b", "llama3_405b")


def transformers_model(cfg: ModelConfig) -> torch.nn.Module:
    config = transformers.LlamaConfig.from_dict(LLAMA.hf_config(cfg, "float32"))
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_transformers_builds_our_model_from_our_config_json(flavor):
    cfg = compose_job_config([f"model={flavor}"]).model
    theirs = transformers_model(cfg)
    shapes = {name: tuple(p.shape) for name, p in theirs.state_dict().items()}
    if cfg.tie_word_embeddings:  # one matrix, which HF's state dict lists under both names
        assert theirs.lm_head.weight is theirs.model.embed_tokens.weight
        del shapes["lm_head.weight"]
    assert shapes == LLAMA.expected_shapes(cfg)
    with torch.device("meta"):
        ours = build_model(cfg)
    assert sum(p.numel() for p in theirs.parameters()) == ours.num_params()


@pytest.mark.parametrize("flavor", FLAVORS)
def test_our_fields_come_back_from_transformers_config(flavor):
    cfg = compose_job_config([f"model={flavor}"]).model
    saved = transformers.LlamaConfig.from_dict(LLAMA.hf_config(cfg, "float32")).to_dict()
    back = ModelConfig(**fields_from_hf(saved))
    # intermediate_size is given outright where ours is derived from multiple_of/ffn_dim_multiplier.
    assert dataclasses.replace(back, name=cfg.name, flavor=cfg.flavor).ffn_hidden_dim == cfg.ffn_hidden_dim
    for field in ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "norm_eps", "max_seq_len"):
        assert getattr(back, field) == getattr(cfg, field), field
    for field in ("rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
        assert getattr(back, field) == getattr(cfg, field), field
    assert back.tie_word_embeddings == cfg.tie_word_embeddings


def test_meta_llama3_files_with_rope_scaling_are_read():
    """The config.json Meta ships with Llama 3.1 8B (transformers 4's spelling: rope_scaling beside rope_theta)."""
    meta = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    ours = compose_job_config(["model=llama3_8b"]).model
    read = ModelConfig(**fields_from_hf(meta))
    assert read.ffn_hidden_dim == ours.ffn_hidden_dim
    assert (read.rope_scaling_factor, read.rope_theta) == (ours.rope_scaling_factor, ours.rope_theta)


OTHER_FLAVORS = {
    "qwen3_debug": transformers.Qwen3ForCausalLM,
    "qwen3_8b": transformers.Qwen3ForCausalLM,
    "qwen3_moe_debug": transformers.Qwen3MoeForCausalLM,
    "qwen3_30b_a3b": transformers.Qwen3MoeForCausalLM,
    "deepseek_v3_debug": transformers.DeepseekV3ForCausalLM,
    "deepseek_v3_16b": transformers.DeepseekV3ForCausalLM,
    "deepseek_v3_671b": transformers.DeepseekV3ForCausalLM,
    "gpt_oss_debug": transformers.GptOssForCausalLM,
    "gpt_oss_20b": transformers.GptOssForCausalLM,
    "gpt_oss_120b": transformers.GptOssForCausalLM,
}


@pytest.mark.parametrize("flavor", OTHER_FLAVORS)
def test_transformers_builds_each_familys_model_from_our_config_json_and_it_reads_back(flavor):
    """Qwen3, Qwen3-MoE, DeepSeek-V3 and GPT-OSS: the config.json we write is one transformers builds the same
    model from (names and shapes, experts in its in-memory fused layout; the parameter count), and
    reading it back gives every field a checkpoint is compared on."""
    from operator import attrgetter

    cfg = compose_job_config([f"model={flavor}"]).model
    fmt = FAMILIES[cfg.name].hf
    model_class = OTHER_FLAVORS[flavor]
    config = model_class.config_class.from_dict(fmt.hf_config(cfg, "float32"))
    with torch.device("meta"):
        theirs = model_class(config)
        ours = build_model(cfg)
    shapes = {name: tuple(p.shape) for name, p in theirs.state_dict().items()}
    assert shapes == fmt.expected_shapes(cfg, fused=cfg.moe.enabled)
    assert sum(p.numel() for p in theirs.parameters()) == ours.num_params()
    back = FAMILIES[cfg.name].config(**fmt.fields_from_hf(config.to_dict(), refusing("model.hf_path", "f")))
    for field in fmt.compared:
        assert attrgetter(field)(back) == attrgetter(field)(cfg), field

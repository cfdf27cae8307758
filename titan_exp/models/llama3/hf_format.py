"""Llama 3 in Hugging Face's format (`LlamaForCausalLM`), torch-free (models/hf.py). What HF names
differently: the config's keys, the parameters' names, and the rows of q/k, which HF orders for
its rotate-half rotary embedding (each head's even channels, then its odd ones) where Meta's
interleaved pairs are ours (checkpoint/hf.py permutes them on the way in and out)."""

from titan_exp.models.config import ModelConfig
from titan_exp.models.hf import HFFormat, hf_field, hf_rope, hf_value

# Our model fields from HF's config: (field, HF key, its default where a config.json may leave it
# out: transformers' LlamaConfig's), read as they are.
_REQUIRED = ("dim", "hidden_size"), ("n_layers", "num_hidden_layers"), ("n_heads", "num_attention_heads")
_DEFAULTED = (
    ("vocab_size", "vocab_size", 32000),
    ("norm_eps", "rms_norm_eps", 1e-6),
    ("max_seq_len", "max_position_embeddings", 2048),
    ("intermediate_size", "intermediate_size", 11008),
    ("tie_word_embeddings", "tie_word_embeddings", False),
)


class LlamaFormat(HFFormat):
    model_types = ("llama",)
    layer_keys = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    compared = (
        "dim",
        "n_layers",
        "n_heads",
        "kv_heads",
        "vocab_size",
        "ffn_hidden_dim",
        "tie_word_embeddings",
        "norm_eps",
        "rope_theta",
        "rope_scaling_factor",
    )
    compared_keys = {"kv_heads": "n_kv_heads", "ffn_hidden_dim": "intermediate_size"}
    # Heads of a width of their own (config.json's head_dim); Llama's are hidden_size / heads.
    heads_own_width = False

    def fields_from_hf(self, hf: dict, refuse) -> dict[str, object]:
        for flag in ("attention_bias", "mlp_bias"):
            if hf_value(hf, flag, bool, refuse, False):
                raise refuse(f"{flag}=true; Llama 3's layers have no biases")
        if (act := hf_value(hf, "hidden_act", str, refuse, "silu")) != "silu":
            raise refuse(f"hidden_act={act}; Llama 3's feed-forward is SwiGLU (silu)")
        fields = {ours: hf_field(hf, theirs, ours, refuse) for ours, theirs in _REQUIRED}
        fields |= {ours: hf_field(hf, theirs, ours, refuse, default) for ours, theirs, default in _DEFAULTED}
        fields["n_kv_heads"] = hf_field(hf, "num_key_value_heads", "n_kv_heads", refuse, fields["n_heads"])
        head_dim = hf_value(hf, "head_dim", int, refuse, None)
        if self.heads_own_width:
            fields["attention_head_dim"] = head_dim
        elif head_dim is not None and head_dim * fields["n_heads"] != fields["dim"]:
            raise refuse(f"head_dim={head_dim}; heads here are hidden_size / num_attention_heads wide")
        return {**fields, **_rope_fields(hf, refuse)}

    def refusal(self, cfg: ModelConfig) -> str | None:
        if cfg.moe.enabled:
            return "LlamaForCausalLM has no experts; set model.moe.num_experts=0"
        if cfg.attention_head_dim and cfg.attention_head_dim * cfg.n_heads != cfg.dim:
            return "LlamaForCausalLM's heads are dim / n_heads wide; set model.attention_head_dim=null"
        return None

    def permuted_heads(self, name: str, cfg: ModelConfig) -> int | None:
        if name.endswith("attention.wq.weight"):
            return cfg.n_heads
        if name.endswith("attention.wk.weight"):
            return cfg.kv_heads
        return None

    def hf_config(self, cfg: ModelConfig, dtype: str) -> dict:
        rope: dict[str, object] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
        if cfg.rope_scaling_factor is not None:
            rope.update(
                rope_type="llama3",
                factor=cfg.rope_scaling_factor,
                low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_seq_len,
            )
        return {
            **self.shared_config(cfg, dtype, rope),
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "mlp_bias": False,
        }

    def layer_shapes(self, cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
        hd, ffn = cfg.head_dim, cfg.ffn_hidden_dim
        return {
            "attention.wq.weight": (cfg.n_heads * hd, cfg.dim),
            "attention.wk.weight": (cfg.kv_heads * hd, cfg.dim),
            "attention.wv.weight": (cfg.kv_heads * hd, cfg.dim),
            "attention.wo.weight": (cfg.dim, cfg.n_heads * hd),
            "feed_forward.w1.weight": (ffn, cfg.dim),
            "feed_forward.w2.weight": (cfg.dim, ffn),
            "feed_forward.w3.weight": (ffn, cfg.dim),
            "attention_norm.weight": (cfg.dim,),
            "ffn_norm.weight": (cfg.dim,),
        }


def _rope_fields(hf: dict, refuse) -> dict[str, object]:
    """rope_parameters (transformers 5) or rope_theta + rope_scaling (earlier ones, Meta's own files):
    default, or Llama 3's frequency scaling."""
    rope, within, kind, fields = hf_rope(hf, refuse, 10000.0)
    if kind == "default":
        return {**fields, "rope_scaling_factor": None}
    if kind != "llama3":
        raise refuse(f"rope_type={kind}; only Llama 3's frequency scaling (llama3) is built here")
    scaling = (
        ("rope_scaling_factor", "factor"),
        ("rope_low_freq_factor", "low_freq_factor"),
        ("rope_high_freq_factor", "high_freq_factor"),
        ("rope_original_max_seq_len", "original_max_position_embeddings"),
    )
    return fields | {ours: hf_field(rope, theirs, ours, refuse, within=within) for ours, theirs in scaling}

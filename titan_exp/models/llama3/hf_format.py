"""Llama 3 in Hugging Face's format (`LlamaForCausalLM`: config.json + safetensors), torch-free: the
launching process reads a checkpoint's shape from here before any rank starts. What HF names
differently: the config's keys, the parameters' names, and the rows of q/k, which HF orders for
its rotate-half rotary embedding (each head's even channels, then its odd ones) where Meta's
interleaved pairs are ours (checkpoint/hf.py permutes them on the way in and out)."""

import json
import math
import re
import struct
from pathlib import Path

from titan_exp.models.config import ModelConfig
from titan_exp.rules import ConfigError

CONFIG_FILE = "config.json"

# Our parameter names (a layer's with {} for its index) and HF's.
_LAYER_KEYS = {
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
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")

# The weights whose rows HF orders for rotate-half rotary embeddings.
ROTARY_KEYS = ("attention.wq.weight", "attention.wk.weight")


def hf_key(name: str) -> str:
    """HF's name of our parameter `name` (e.g. layers.3.attention.wq.weight)."""
    if name in _TOP_KEYS:
        return _TOP_KEYS[name]
    match = _LAYER.match(name)
    if not match or match.group(2) not in _LAYER_KEYS:
        raise KeyError(f"{name} has no Hugging Face counterpart")
    return f"model.layers.{match.group(1)}.{_LAYER_KEYS[match.group(2)]}"


def is_tied_output(name: str, cfg: ModelConfig) -> bool:
    """The output projection of a tied model: the embedding itself, which HF stores once."""
    return cfg.tie_word_embeddings and name == "output.weight"


def heads_of(name: str, cfg: ModelConfig) -> int | None:
    """The heads whose rows HF permutes in `name` (None: not a rotary weight)."""
    if name.endswith(ROTARY_KEYS[0]):
        return cfg.n_heads
    if name.endswith(ROTARY_KEYS[1]):
        return cfg.kv_heads
    return None


# Our model fields from HF's config: (field, HF key), read as they are.
_SAME_VALUES = (
    ("dim", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("vocab_size", "vocab_size"),
    ("norm_eps", "rms_norm_eps"),
    ("max_seq_len", "max_position_embeddings"),
    ("intermediate_size", "intermediate_size"),
    ("tie_word_embeddings", "tie_word_embeddings"),
)


def read_hf_config(folder: str, key: str) -> dict:
    """The config.json of a HF checkpoint folder; `key`: the config key that named the folder."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(key, folder, f"no {CONFIG_FILE} there; point it at a Hugging Face model folder")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(key, folder, f"its {CONFIG_FILE} cannot be read ({err})") from None


def fields_from_hf(hf: dict, key: str, folder: str) -> dict[str, object]:
    """Our model fields (ModelConfig) of a HF Llama config; a config this model cannot be is refused,
    naming `key`, the config key that gave its `folder`."""

    def refuse(why: str) -> ConfigError:
        return ConfigError(key, folder, f"its {CONFIG_FILE} has {why}")

    if hf.get("model_type") != "llama":
        raise refuse(f"model_type={hf.get('model_type')}; only llama (LlamaForCausalLM) is built here")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise refuse(f"{flag}=true; Llama 3's layers have no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act={hf['hidden_act']}; Llama 3's feed-forward is SwiGLU (silu)")
    fields = {ours: hf[theirs] for ours, theirs in _SAME_VALUES if theirs in hf}
    fields["n_kv_heads"] = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        raise refuse(f"head_dim={head_dim}; heads here are hidden_size / num_attention_heads wide")
    rope = _rope_fields(hf)
    if rope is None:
        raise refuse(f"rope_type={_rope_type(hf)}; only Llama 3's frequency scaling (llama3) is built here")
    return {**fields, **rope}


def _rope_type(hf: dict) -> str:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return rope.get("rope_type", rope.get("type", "default"))


def _rope_fields(hf: dict) -> dict[str, object] | None:
    """rope_parameters (transformers 5) or rope_theta + rope_scaling (earlier ones, Meta's own files);
    None: a scaling other than Llama 3's."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = _rope_type(hf)
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling_factor": None}
    if kind != "llama3":
        return None
    return {
        "rope_theta": float(theta),
        "rope_scaling_factor": float(rope["factor"]),
        "rope_low_freq_factor": float(rope["low_freq_factor"]),
        "rope_high_freq_factor": float(rope["high_freq_factor"]),
        "rope_original_max_seq_len": int(rope["original_max_position_embeddings"]),
    }


def hf_config(cfg: ModelConfig, dtype: str) -> dict:
    """The config.json `transformers` opens our model with (LlamaForCausalLM)."""
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
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        # Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta and rope_scaling.
        "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling_factor is None else rope,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF's name and shape of every tensor a checkpoint of `cfg` holds."""
    hd, ffn = cfg.head_dim, cfg.ffn_hidden_dim
    per_layer = {
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
    shapes = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim), "norm.weight": (cfg.dim,)}
    if not cfg.tie_word_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, cfg.dim)
    for layer in range(cfg.n_layers):
        shapes.update({f"layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    return {hf_key(name): shape for name, shape in shapes.items()}


def safetensors_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in the folder's *.safetensors files, from their JSON headers alone (the
    format: an 8-byte little-endian length, then the header)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        shapes.update({name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"})
    return shapes


# Our fields compared with a checkpoint's config.json, in the order a refusal names them.
_COMPARED = (
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


def check_hf_checkpoint(cfg: ModelConfig, folder: str, key: str) -> None:
    """A HF checkpoint that `cfg`'s model can load: its config.json describes the same model (else the
    differing field is named, with the fix) and its safetensors hold every tensor in its shape."""
    theirs = ModelConfig(**fields_from_hf(read_hf_config(folder, key), key, folder))
    for name in _COMPARED:
        ours_value, their_value = getattr(cfg, name), getattr(theirs, name)
        if ours_value != their_value and not _close(ours_value, their_value):
            field = {"kv_heads": "n_kv_heads", "ffn_hidden_dim": "intermediate_size"}.get(name, name)
            raise ConfigError(
                f"model.{field}",
                ours_value,
                f"the checkpoint in {folder} has {their_value}; add model=hf model.hf_path={folder} "
                "to take the model's shape from it",
            )
    found = safetensors_shapes(folder)
    if not found:
        raise ConfigError(key, folder, "holds no *.safetensors files; point it at a Hugging Face model folder")
    for name, shape in expected_shapes(cfg).items():
        if name not in found:
            raise ConfigError(key, folder, f"has no tensor {name}, which the model needs")
        if found[name] != shape:
            raise ConfigError(key, folder, f"holds {name} of shape {list(found[name])}, the model's is {list(shape)}")


def _close(a: object, b: object) -> bool:
    return isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-6)

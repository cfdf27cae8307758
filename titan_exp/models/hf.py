"""Models in Hugging Face's format (a folder of config.json and safetensors), torch-free: the
launching process reads a folder's shape before any rank starts (its tensors are checked in
hf_tensors.py). What a family names differently (config keys, parameter names, the rows HF orders
its own way) is its `HFFormat`, in its folder; the weights move through checkpoint/hf.py."""

import math
import re
import typing
from pathlib import Path

from titan_exp.models.config import ModelConfig
from titan_exp.rules import ConfigError
from titan_exp.untrusted import read_json

CONFIG_FILE = "config.json"
# Where a config.json says its weights' dtype: transformers 5 writes dtype, earlier ones torch_dtype.
DTYPE_KEYS = ("dtype", "torch_dtype")

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


class HFFormat:
    """One family's models as Hugging Face writes them. A family's folder subclasses it and fills
    in the names; the methods here are what every format shares."""

    # config.json's model_type values the family reads (models/registry.py picks the family by them).
    model_types: tuple[str, ...] = ()
    # Our parameter names (a layer's without its `layers.N.` prefix) and HF's, within a layer and outside.
    layer_keys: dict[str, str] = {}
    top_keys: dict[str, str] = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    # A layer's stacked expert weights (ours: experts × ...) and HF's name of expert {}'s matrix,
    # one tensor per expert as published checkpoints hold them (and as written here): the names
    # of transformers' MoE models (Qwen2/3-MoE, DeepSeek-V3 and their kin).
    expert_keys: dict[str, str] = {
        "moe.experts.w1": "mlp.experts.{}.gate_proj.weight",
        "moe.experts.w3": "mlp.experts.{}.up_proj.weight",
        "moe.experts.w2": "mlp.experts.{}.down_proj.weight",
    }
    # The fused layout transformers also writes (save_original_format=False): HF's name of one
    # tensor (experts × ...) and the stacked weights of ours it concatenates along its dim 1.
    fused_expert_keys: dict[str, tuple[str, ...]] = {
        "mlp.experts.gate_up_proj": ("moe.experts.w1", "moe.experts.w3"),
        "mlp.experts.down_proj": ("moe.experts.w2",),
    }
    # How a fused tensor holds our parts: one after the other along dim 1 (transformers' Qwen3
    # gate_up_proj) or interleaved row by row (GPT-OSS's: gate, up, gate, up, ...); and whether HF
    # stores its matrices transposed (experts × in × out, GPT-OSS's) where ours are experts × out × in.
    fused_interleaved = False
    fused_transposed = False
    # Our fields (dotted within a section) compared with a checkpoint's config.json before it is
    # loaded, in the order a refusal names them; the keys a refusal names for them where they differ.
    compared: tuple[str, ...] = ()
    compared_keys: dict[str, str] = {}

    def fields_from_hf(self, hf: dict, refuse) -> dict[str, object]:
        """Our model fields of a HF config.json; `refuse(why)` makes the error of one this model cannot be."""
        raise NotImplementedError

    def hf_config(self, cfg: ModelConfig, dtype: str) -> dict:
        """The config.json `transformers` opens our model with."""
        raise NotImplementedError

    def refusal(self, cfg: ModelConfig) -> str | None:
        """Why `cfg` cannot be read or written in this format (None: it can)."""
        return None

    @staticmethod
    def shared_config(cfg: ModelConfig, dtype: str, rope: dict[str, object]) -> dict:
        """What every family's config.json says alike: the decoder's sizes, SwiGLU, no attention
        biases, the rotary parameters `rope` in both spellings (transformers 5 reads
        rope_parameters, 4.x rope_theta and rope_scaling) and the weights' dtype."""
        return {
            "hidden_size": cfg.dim,
            "intermediate_size": cfg.ffn_hidden_dim,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "vocab_size": cfg.vocab_size,
            "rms_norm_eps": cfg.norm_eps,
            "max_position_embeddings": cfg.max_seq_len,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_parameters": rope,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": None if cfg.rope_scaling_factor is None else rope,
            **{key: dtype for key in DTYPE_KEYS},
        }

    def cautions(self, hf: dict) -> list[str]:
        """What of a folder with this config.json is not read (said before the job starts)."""
        return []

    def permuted_heads(self, name: str, cfg: ModelConfig) -> int | None:
        """The heads whose rows HF orders differently in our parameter `name` (rotate-half rotary
        embeddings: each head's even channels, then its odd ones); None: the same rows."""
        return None

    def top_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Our name and shape of each tensor outside the layers."""
        shapes = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim), "norm.weight": (cfg.dim,)}
        if not cfg.tie_word_embeddings:
            shapes["output.weight"] = (cfg.vocab_size, cfg.dim)
        return shapes

    def layer_shapes(self, cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
        """Our name (within the layer) and shape of each tensor of layer `layer`."""
        raise NotImplementedError

    def weight_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Our name and shape of every weight of `cfg`'s model, as this format holds it."""
        shapes = dict(self.top_shapes(cfg))
        for layer in range(cfg.n_layers):
            shapes |= {f"layers.{layer}.{name}": shape for name, shape in self.layer_shapes(cfg, layer).items()}
        return shapes

    def expected_shapes(self, cfg: ModelConfig, fused: bool = False) -> dict[str, tuple[int, ...]]:
        """HF's name and shape of every tensor a checkpoint of `cfg` holds (`fused`: its experts in
        transformers' fused layout)."""
        shapes = {self.hf_key(name): shape for name, shape in self.top_shapes(cfg).items()}
        for layer in range(cfg.n_layers):
            ours = self.layer_shapes(cfg, layer)
            for name, shape in ours.items():
                if not self.is_experts(f"layers.{layer}.{name}"):
                    shapes[self.hf_key(f"layers.{layer}.{name}")] = shape
                elif not fused:
                    shapes |= {self.expert_key(f"layers.{layer}.{name}", j): shape[1:] for j in range(shape[0])}
            if fused and any(self.is_experts(f"layers.{layer}.{name}") for name in ours):
                for theirs, parts in self.fused_expert_keys.items():
                    experts, rows, *width = ours[parts[0]]
                    shapes[f"model.layers.{layer}.{theirs}"] = self.stored((experts, rows * len(parts), *width))
        return shapes

    def stored(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A fused tensor's shape as HF stores it, of its shape in our orientation (and back again:
        a transposition is its own inverse)."""
        if self.fused_transposed and len(shape) == 3:
            return (shape[0], shape[2], shape[1])
        return shape

    def hf_key(self, name: str) -> str:
        """HF's name of our parameter `name` (e.g. layers.3.attention.wq.weight)."""
        if name in self.top_keys:
            return self.top_keys[name]
        match = _LAYER.match(name)
        if not match or match.group(2) not in self.layer_keys:
            raise KeyError(f"{name} has no Hugging Face counterpart")
        return f"model.layers.{match.group(1)}.{self.layer_keys[match.group(2)]}"

    def is_experts(self, name: str) -> bool:
        """Whether our `name` stacks a layer's experts (layers.N.moe.experts.w1)."""
        match = _LAYER.match(name)
        fused = (ours for parts in self.fused_expert_keys.values() for ours in parts)
        return bool(match) and (match.group(2) in self.expert_keys or match.group(2) in fused)

    def expert_key(self, name: str, expert: int) -> str:
        """HF's name of expert `expert`'s matrix of our stacked `name`."""
        match = _LAYER.match(name)
        return f"model.layers.{match.group(1)}.{self.expert_keys[match.group(2)].format(expert)}"

    def fused_key(self, name: str) -> tuple[str, int, int]:
        """(HF's fused tensor that holds our stacked `name`, which of its equal parts along dim 1 is
        ours, how many parts it has); see fused_expert_keys."""
        match = _LAYER.match(name)
        for theirs, parts in self.fused_expert_keys.items():
            if match.group(2) in parts:
                return f"model.layers.{match.group(1)}.{theirs}", parts.index(match.group(2)), len(parts)
        raise KeyError(f"{name} is in no fused tensor")

    def is_fused(self, names: set[str] | dict) -> bool:
        """Whether a checkpoint holding tensors `names` keeps its experts in the fused layout (the
        only one of a format without per-expert names)."""
        return not self.expert_keys or any(name.endswith(tuple(self.fused_expert_keys)) for name in names)

    @staticmethod
    def is_tied_output(name: str, cfg: ModelConfig) -> bool:
        """The output projection of a tied model: the embedding itself, which HF stores once."""
        return cfg.tie_word_embeddings and name == "output.weight"


def read_hf_config(folder: str, key: str) -> dict:
    """The config.json of a HF checkpoint folder (a table of settings, read within bounds:
    untrusted.py); `key`: the config key that named the folder."""
    path = Path(folder) / CONFIG_FILE
    if not path.exists():
        raise ConfigError(key, folder, f"no {CONFIG_FILE} there; point it at a Hugging Face model folder")
    try:
        hf = read_json(path)
    except ValueError as err:
        raise ConfigError(key, folder, f"its {CONFIG_FILE} cannot be read: {err}") from None
    if not isinstance(hf, dict):
        raise ConfigError(key, folder, f"its {CONFIG_FILE} holds a {_json_kind(hf)}, not a table of settings")
    return hf


_REQUIRED = object()


def hf_value(hf: dict, theirs: str, kind: object, refuse, default: object = _REQUIRED, within: str = "") -> object:
    """config.json's `theirs` (in its table `within`, e.g. rope_parameters), of `kind` (int, float,
    bool, str, dict; a float may be written as an integer, never a bool as a number); `default`
    where it is missing (else a refusal)."""
    named = f"{within}.{theirs}" if within else theirs
    if theirs not in hf or (hf[theirs] is None and default is not _REQUIRED):
        if default is _REQUIRED:
            raise refuse(f"no {named}, which the model needs")
        return default
    value = hf[theirs]
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind or (kind is float and not math.isfinite(value)):
        raise refuse(f"{named}={_shown(value)}, not {_KIND_NAMES[kind]}")
    return value


def hf_field(hf: dict, theirs: str, ours: str, refuse, default: object = _REQUIRED, within: str = "") -> object:
    """config.json's `theirs` as our ModelConfig field `ours`, of that field's type."""
    hint = typing.get_type_hints(ModelConfig)[ours]
    kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    return hf_value(hf, theirs, kind, refuse, default, within)


_KIND_NAMES = {
    int: "an integer",
    float: "a finite number",
    bool: "true or false",
    str: "text",
    dict: "a table",
    list: "a list",
}


def _json_kind(value: object) -> str:
    return {list: "list", dict: "table", str: "text", type(None): "null", bool: "boolean"}.get(type(value), "number")


def _shown(value: object) -> str:
    text = (
        repr(value)
        if isinstance(value, str)
        else f"a {_json_kind(value)}"
        if isinstance(value, (list, dict))
        else value
    )
    return str(text)[:60]


def hf_rope(hf: dict, refuse, default_theta: float) -> tuple[dict, str, str, dict[str, object]]:
    """A config.json's rotary embedding: (its table, that table's key, its rope_type, our
    rope_theta field). transformers 5 writes rope_parameters (the theta inside); earlier ones and
    the published files rope_theta beside a rope_scaling table."""
    within = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf_value(hf, within, dict, refuse, {})
    theta = hf_field(rope, "rope_theta", "rope_theta", refuse, None, within)
    theta = theta or hf_field(hf, "rope_theta", "rope_theta", refuse, default_theta)
    kind = str(rope.get("rope_type", rope.get("type", "default")))
    return rope, within, kind, {"rope_theta": theta}


def hf_yarn_fields(rope: dict, within: str, refuse) -> dict[str, object]:
    """Our YaRN fields of a rope table of rope_type yarn (its magnitude factor is the family's)."""
    return {
        "rope_scaling_type": "yarn",
        "rope_scaling_factor": hf_field(rope, "factor", "rope_scaling_factor", refuse, within=within),
        "rope_original_max_seq_len": hf_field(
            rope, "original_max_position_embeddings", "rope_original_max_seq_len", refuse, within=within
        ),
        "rope_beta_fast": hf_field(rope, "beta_fast", "rope_beta_fast", refuse, 32.0, within),
        "rope_beta_slow": hf_field(rope, "beta_slow", "rope_beta_slow", refuse, 1.0, within),
        "rope_yarn_truncate": hf_field(rope, "truncate", "rope_yarn_truncate", refuse, True, within),
    }


def hf_yarn_rope(cfg: ModelConfig) -> dict[str, object]:
    """hf_yarn_fields written back: config.json's rope table of our rotary fields, default or YaRN
    (a family adds its magnitude keys)."""
    rope: dict[str, object] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling_factor is None:
        return rope
    return rope | {
        "rope_type": "yarn",
        "factor": cfg.rope_scaling_factor,
        "original_max_position_embeddings": cfg.rope_original_max_seq_len,
        "beta_fast": cfg.rope_beta_fast,
        "beta_slow": cfg.rope_beta_slow,
        "truncate": cfg.rope_yarn_truncate,
    }


def hf_num_experts(hf: dict, refuse) -> int:
    """A MoE config.json's routed experts: published configs say num_experts, transformers 5 writes
    num_local_experts (its configs map the one name to the other)."""
    return hf_value(hf, "num_experts" if "num_experts" in hf else "num_local_experts", int, refuse)


def hf_aux_loss_coeff(hf: dict, refuse) -> float | None:
    """The auxiliary load-balancing loss's coefficient (router_aux_loss_coef), or None: transformers
    adds that loss only where the config asks for router logits."""
    aux = hf_value(hf, "router_aux_loss_coef", float, refuse, 0.001)
    return aux if hf_value(hf, "output_router_logits", bool, refuse, False) and aux else None


def hf_aux_loss_config(coeff: float | None) -> dict[str, object]:
    """hf_aux_loss_coeff written back: the keys that make transformers add the loss, or not."""
    return {"output_router_logits": coeff is not None, "router_aux_loss_coef": coeff or 0.0}


def refusing(key: str, folder: str):
    """What a format calls to refuse a folder's config.json, naming `key`, the config key that gave `folder`."""

    def refuse(why: str) -> ConfigError:
        return ConfigError(key, folder, f"its {CONFIG_FILE} has {why}")

    return refuse

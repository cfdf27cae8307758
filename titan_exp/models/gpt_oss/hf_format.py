"""GPT-OSS in Hugging Face's format (`GptOssForCausalLM`), torch-free (models/hf.py). What HF names
differently: the attention's projections with their biases and sinks, the router (`mlp.router`,
with a bias), and the experts, which HF keeps fused per layer only: `gate_up_proj` (experts × dim
× 2·hidden, gate and up interleaved column by column) and `down_proj` (experts × hidden × dim),
each with its bias; the published checkpoints hold both matrices as MXFP4 (`…_blocks`/`…_scales`,
experts × out × in), read dequantized (checkpoint/safetensors_folder.py). HF rotates half-blocks:
q/k rows and their biases are permuted as Llama's."""

from titan_exp.models.common.moe.config import CLAMPED_GATE_GAIN, MoEConfig
from titan_exp.models.config import ModelConfig
from titan_exp.models.gpt_oss.config import GptOssConfig
from titan_exp.models.hf import (
    HFFormat,
    hf_aux_loss_coeff,
    hf_aux_loss_config,
    hf_field,
    hf_num_experts,
    hf_rope,
    hf_value,
    hf_yarn_fields,
    hf_yarn_rope,
)

_SLIDING, _FULL = "sliding_attention", "full_attention"
# What transformers' GptOssConfig takes where config.json names no rotary scaling: GPT-OSS's YaRN.
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


class GptOssFormat(HFFormat):
    model_types = ("gpt_oss",)
    layer_keys = {
        **{
            f"attention.{ours}.{kind}": f"self_attn.{theirs}.{kind}"
            for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
            for kind in ("weight", "bias")
        },
        "attention.sinks": "self_attn.sinks",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "moe.router.gate.weight": "mlp.router.weight",
        "moe.router.gate.bias": "mlp.router.bias",
    }
    expert_keys: dict[str, str] = {}  # no per-expert layout: only the fused one
    fused_expert_keys = {
        "mlp.experts.gate_up_proj": ("moe.experts.w1", "moe.experts.w3"),
        "mlp.experts.gate_up_proj_bias": ("moe.experts.w1_bias", "moe.experts.w3_bias"),
        "mlp.experts.down_proj": ("moe.experts.w2",),
        "mlp.experts.down_proj_bias": ("moe.experts.w2_bias",),
    }
    fused_interleaved = True
    fused_transposed = True
    compared = (
        "dim",
        "n_layers",
        "n_heads",
        "kv_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
        "norm_eps",
        "rope_theta",
        "rope_scaling_factor",
        "rope_scaling_type",
        "rope_original_max_seq_len",
        "rope_yarn_truncate",
        "sliding_window",
        "moe.num_experts",
        "moe.top_k",
        "moe.hidden_dim",
        "moe.swiglu_limit",
    )
    compared_keys = {"kv_heads": "n_kv_heads", "head_dim": "attention_head_dim"}

    def fields_from_hf(self, hf: dict, refuse) -> dict[str, object]:
        if not hf_value(hf, "attention_bias", bool, refuse, True):
            raise refuse("attention_bias=false; GPT-OSS's attention projections have biases")
        if (alpha := hf_value(hf, "swiglu_alpha", float, refuse, CLAMPED_GATE_GAIN)) != CLAMPED_GATE_GAIN:
            raise refuse(f"swiglu_alpha={alpha}; the experts' gate gain here is GPT-OSS's {CLAMPED_GATE_GAIN}")
        layers = hf_field(hf, "num_hidden_layers", "n_layers", refuse)
        # Walked as long as config.json's own list, never num_hidden_layers (the model rules bound it later).
        types = hf_value(hf, "layer_types", list, refuse, None)
        if types is not None and (len(types) != layers or types != _layer_types(len(types))):
            raise refuse("layer_types other than sliding and full attention alternating from the first layer")
        heads = hf_field(hf, "num_attention_heads", "n_heads", refuse)
        hidden = hf_value(hf, "intermediate_size", int, refuse)
        fields = {
            "dim": hf_field(hf, "hidden_size", "dim", refuse),
            "n_layers": layers,
            "n_heads": heads,
            "n_kv_heads": hf_field(hf, "num_key_value_heads", "n_kv_heads", refuse, 8),
            "attention_head_dim": hf_field(hf, "head_dim", "attention_head_dim", refuse, 64),
            "vocab_size": hf_field(hf, "vocab_size", "vocab_size", refuse),
            "norm_eps": hf_field(hf, "rms_norm_eps", "norm_eps", refuse, 1e-5),
            "max_seq_len": hf_field(hf, "max_position_embeddings", "max_seq_len", refuse, 131072),
            "intermediate_size": hidden,  # no dense layer; the experts' width
            "tie_word_embeddings": hf_field(hf, "tie_word_embeddings", "tie_word_embeddings", refuse, False),
            "sliding_window": hf_value(hf, "sliding_window", int, refuse, 128),
        }
        moe = MoEConfig(
            num_experts=hf_num_experts(hf, refuse),
            top_k=hf_value(hf, "num_experts_per_tok", int, refuse),
            hidden_dim=hidden,
            route_norm=True,  # a softmax over the chosen experts' logits
            bias=True,
            swiglu_limit=hf_value(hf, "swiglu_limit", float, refuse, 7.0),
            aux_loss_coeff=hf_aux_loss_coeff(hf, refuse),
        )
        return {**fields, **self._rope_fields(hf, refuse), "moe": moe}

    @staticmethod
    def _rope_fields(hf: dict, refuse) -> dict[str, object]:
        """None, or YaRN with its magnitude factor derived from its factor (GPT-OSS's)."""
        if not (hf.get("rope_parameters") or hf.get("rope_scaling")):  # transformers' GptOssConfig's own then
            hf = {**hf, "rope_parameters": _DEFAULT_ROPE}
        rope, within, kind, fields = hf_rope(hf, refuse, 150000.0)
        if kind == "default":
            return {**fields, "rope_scaling_factor": None}
        if kind != "yarn":
            raise refuse(f"{within}.rope_type={kind[:20]}; the rotary scalings read here: default, yarn")
        for derived in ("attention_factor", "mscale", "mscale_all_dim"):
            if rope.get(derived) is not None:
                raise refuse(f"{within}.{derived}; here YaRN's magnitude is 0.1·ln(factor) + 1, as GPT-OSS's")
        return {**fields, **hf_yarn_fields(rope, within, refuse)}

    def refusal(self, cfg: ModelConfig) -> str | None:
        moe = cfg.moe
        if not (moe.enabled and moe.bias and moe.swiglu_limit is not None and moe.n_dense_layers == 0):
            return "GptOssForCausalLM's every layer has experts with biases and the clamped SwiGLU (model.moe)"
        if moe.num_shared_experts or moe.score_func != "softmax" or moe.n_groups != 1 or not moe.route_norm:
            return "GptOssForCausalLM routes by a softmax over the chosen experts, ungrouped, without shared experts"
        if moe.route_scale != 1.0 or moe.load_balance_coeff is not None:
            return "GptOssForCausalLM neither scales the routed output nor biases the choice"
        if cfg.rope_scaling_factor is not None and cfg.rope_scaling_type != "yarn":
            return "GptOssForCausalLM's rotary scaling is YaRN's"
        return None

    def permuted_heads(self, name: str, cfg: ModelConfig) -> int | None:
        if name.endswith(("attention.wq.weight", "attention.wq.bias")):
            return cfg.n_heads
        if name.endswith(("attention.wk.weight", "attention.wk.bias")):
            return cfg.kv_heads
        return None

    def hf_config(self, cfg: GptOssConfig, dtype: str) -> dict:
        moe = cfg.moe
        return {
            **self.shared_config(cfg, dtype, hf_yarn_rope(cfg)),
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "attention_bias": True,
            "intermediate_size": moe.hidden_dim,
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "swiglu_limit": moe.swiglu_limit,
            "swiglu_alpha": CLAMPED_GATE_GAIN,
            "sliding_window": cfg.sliding_window,
            "layer_types": _layer_types(cfg.n_layers),
            **hf_aux_loss_config(moe.aux_loss_coeff),
        }

    def layer_shapes(self, cfg: GptOssConfig, layer: int) -> dict[str, tuple[int, ...]]:
        q, kv, dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.dim
        experts, hidden = cfg.moe.num_experts, cfg.moe.hidden_dim
        return {
            "attention.wq.weight": (q, dim),
            "attention.wq.bias": (q,),
            "attention.wk.weight": (kv, dim),
            "attention.wk.bias": (kv,),
            "attention.wv.weight": (kv, dim),
            "attention.wv.bias": (kv,),
            "attention.wo.weight": (dim, q),
            "attention.wo.bias": (dim,),
            "attention.sinks": (cfg.n_heads,),
            "attention_norm.weight": (dim,),
            "ffn_norm.weight": (dim,),
            "moe.router.gate.weight": (experts, dim),
            "moe.router.gate.bias": (experts,),
            "moe.experts.w1": (experts, hidden, dim),
            "moe.experts.w3": (experts, hidden, dim),
            "moe.experts.w2": (experts, dim, hidden),
            "moe.experts.w1_bias": (experts, hidden),
            "moe.experts.w3_bias": (experts, hidden),
            "moe.experts.w2_bias": (experts, dim),
        }


def _layer_types(layers: int) -> list[str]:
    """config.json's layer_types of a model of `layers` layers: sliding and full attention alternating."""
    return [_SLIDING if GptOssConfig.is_sliding_layer(i) else _FULL for i in range(layers)]

"""DeepSeek-V3 (and the V2-Lite-shaped 16B) in Hugging Face's format (`DeepseekV3ForCausalLM`),
torch-free (models/hf.py). What HF names differently: latent attention's projections and norms,
the router (`mlp.gate`, with its selection bias `e_score_correction_bias`), the shared experts and
the routed ones (one tensor per expert as published; fused as transformers also writes). Its
rotary rows are DeepSeek's own interleaved pairs (`rope_interleave`), as ours: nothing is
permuted. The published weights are float8 with block scales: read dequantized
(checkpoint/safetensors_folder.py). Their multi-token-prediction layer is not read (not built here)."""

from titan_exp.models.common.moe.config import MoEConfig
from titan_exp.models.config import ModelConfig
from titan_exp.models.deepseek_v3.config import DeepSeekV3Config, MLAConfig
from titan_exp.models.hf import HFFormat, hf_field, hf_rope, hf_value, hf_yarn_fields, hf_yarn_rope

# transformers' latent norms keep their own epsilon (DeepseekV3RMSNorm's default), whatever rms_norm_eps says.
_LATENT_NORM_EPS = 1e-6
# DeepSeek-V3's bias update speed (its paper's γ): config.json carries the bias, not how it moved.
_BIAS_UPDATE = 1e-3


class DeepSeekV3Format(HFFormat):
    model_types = ("deepseek_v3",)
    layer_keys = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "moe.router.gate.weight": "mlp.gate.weight",
        "moe.router.expert_bias": "mlp.gate.e_score_correction_bias",
        "moe.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "moe.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
        "moe.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    compared = (
        "dim",
        "n_layers",
        "n_heads",
        "vocab_size",
        "ffn_hidden_dim",
        "tie_word_embeddings",
        "norm_eps",
        "rope_theta",
        "rope_scaling_factor",
        "mla.kv_lora_rank",
        "mla.q_lora_rank",
        "mla.qk_nope_head_dim",
        "mla.qk_rope_head_dim",
        "mla.v_head_dim",
        "moe.num_experts",
        "moe.top_k",
        "moe.hidden_dim",
        "moe.num_shared_experts",
        "moe.n_dense_layers",
        "moe.n_groups",
        "moe.topk_groups",
    )
    compared_keys = {"ffn_hidden_dim": "intermediate_size"}

    def fields_from_hf(self, hf: dict, refuse) -> dict[str, object]:
        if hf_value(hf, "attention_bias", bool, refuse, False):
            raise refuse("attention_bias=true; latent attention here has no biases")
        if not hf_value(hf, "rope_interleave", bool, refuse, True):
            raise refuse("rope_interleave=false; the rotary rows here are DeepSeek's interleaved pairs")
        if (act := hf_value(hf, "hidden_act", str, refuse, "silu")) != "silu":
            raise refuse(f"hidden_act={act}; the feed-forward here is SwiGLU (silu)")
        if (eps := hf_field(hf, "rms_norm_eps", "norm_eps", refuse, 1e-6)) != _LATENT_NORM_EPS:
            raise refuse(f"rms_norm_eps={eps}; the latent norms keep {_LATENT_NORM_EPS}, here one epsilon serves all")
        heads = hf_field(hf, "num_attention_heads", "n_heads", refuse)
        if hf_value(hf, "num_key_value_heads", int, refuse, heads) != heads:
            raise refuse(
                "num_key_value_heads other than num_attention_heads; latent attention rebuilds every head's k and v"
            )
        fields = {
            "dim": hf_field(hf, "hidden_size", "dim", refuse),
            "n_layers": hf_field(hf, "num_hidden_layers", "n_layers", refuse),
            "n_heads": heads,
            "n_kv_heads": None,
            "vocab_size": hf_field(hf, "vocab_size", "vocab_size", refuse),
            "norm_eps": eps,
            "max_seq_len": hf_field(hf, "max_position_embeddings", "max_seq_len", refuse, 4096),
            "intermediate_size": hf_field(hf, "intermediate_size", "intermediate_size", refuse),
            "tie_word_embeddings": hf_field(hf, "tie_word_embeddings", "tie_word_embeddings", refuse, False),
        }
        rope, mscale = self._rope_fields(hf, refuse)
        mla = MLAConfig(
            kv_lora_rank=hf_value(hf, "kv_lora_rank", int, refuse),
            q_lora_rank=hf_value(hf, "q_lora_rank", int, refuse, 0),
            qk_nope_head_dim=hf_value(hf, "qk_nope_head_dim", int, refuse),
            qk_rope_head_dim=hf_value(hf, "qk_rope_head_dim", int, refuse),
            v_head_dim=hf_value(hf, "v_head_dim", int, refuse),
            mscale=mscale,
        )
        return {**fields, **rope, "mla": mla, "moe": self._moe(hf, refuse)}

    @staticmethod
    def _rope_fields(hf: dict, refuse) -> tuple[dict[str, object], float]:
        """(our rotary fields, MLA's softmax mscale) of rope_parameters or rope_scaling: default or YaRN."""
        rope, within, kind, fields = hf_rope(hf, refuse, 10000.0)
        if kind == "default":
            return {**fields, "rope_scaling_factor": None}, 1.0
        if kind != "yarn":
            raise refuse(f"{within}.rope_type={kind[:20]}; the rotary scalings read here: default, yarn")
        mscale = hf_value(rope, "mscale_all_dim", float, refuse, 0.0, within)
        if hf_value(rope, "mscale", float, refuse, mscale, within) != mscale or not mscale:
            raise refuse(
                f"{within}.mscale other than mscale_all_dim; here YaRN scales the softmax alone (by mscale_all_dim)"
            )
        if hf_value(rope, "attention_factor", float, refuse, None, within) is not None:
            raise refuse(f"{within}.attention_factor; here YaRN leaves the rotary embedding's magnitude as it is")
        return {**fields, **hf_yarn_fields(rope, within, refuse)}, mscale

    @staticmethod
    def _moe(hf: dict, refuse) -> MoEConfig:
        if (scoring := hf_value(hf, "scoring_func", str, refuse, "sigmoid")) not in ("sigmoid", "softmax"):
            raise refuse(f"scoring_func={scoring[:20]}; the router scores here: sigmoid, softmax")
        experts = hf_value(hf, "n_routed_experts", int, refuse)
        return MoEConfig(
            num_experts=experts,
            top_k=hf_value(hf, "num_experts_per_tok", int, refuse),
            hidden_dim=hf_value(hf, "moe_intermediate_size", int, refuse),
            num_shared_experts=hf_value(hf, "n_shared_experts", int, refuse, 0),
            n_dense_layers=hf_value(hf, "first_k_dense_replace", int, refuse, 0),
            score_func=scoring,
            route_norm=hf_value(hf, "norm_topk_prob", bool, refuse, True),
            route_scale=hf_value(hf, "routed_scaling_factor", float, refuse, 1.0),
            n_groups=hf_value(hf, "n_group", int, refuse, 1),
            topk_groups=hf_value(hf, "topk_group", int, refuse, 1),
            load_balance_coeff=_BIAS_UPDATE,
        )

    def cautions(self, hf: dict) -> list[str]:
        mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
        if isinstance(mtp, int) and mtp > 0:
            first = hf.get("num_hidden_layers")
            return [f"its {mtp} multi-token-prediction layer(s) (model.layers.{first}+) are not read: no MTP here"]
        return []

    def refusal(self, cfg: ModelConfig) -> str | None:
        if not cfg.moe.enabled:
            return "DeepseekV3ForCausalLM has experts; set model.moe.num_experts"
        if cfg.moe.load_balance_coeff is None:
            return "DeepseekV3ForCausalLM's router keeps a selection bias; set model.moe.load_balance_coeff"
        if cfg.moe.aux_loss_coeff is not None:
            return "DeepseekV3ForCausalLM balances without an auxiliary loss; set model.moe.aux_loss_coeff=null"
        if cfg.moe.bias or cfg.moe.swiglu_limit is not None:
            return "DeepseekV3ForCausalLM's experts are SwiGLUs without biases or clamps"
        if cfg.norm_eps != _LATENT_NORM_EPS:
            return f"DeepSeek-V3's latent norms keep {_LATENT_NORM_EPS}; set model.norm_eps={_LATENT_NORM_EPS}"
        return None

    def hf_config(self, cfg: DeepSeekV3Config, dtype: str) -> dict:
        mla, moe = cfg.mla, cfg.moe
        rope = hf_yarn_rope(cfg)
        if cfg.rope_scaling_factor is not None:  # YaRN's magnitude on the softmax alone (mscale_all_dim)
            rope |= {"mscale": mla.mscale, "mscale_all_dim": mla.mscale}
        return {
            **self.shared_config(cfg, dtype, rope),
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "num_key_value_heads": cfg.n_heads,
            "rope_interleave": True,
            "kv_lora_rank": mla.kv_lora_rank,
            "q_lora_rank": mla.q_lora_rank or None,
            "qk_nope_head_dim": mla.qk_nope_head_dim,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "n_routed_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.hidden_dim,
            "n_shared_experts": moe.num_shared_experts,
            "first_k_dense_replace": moe.n_dense_layers,
            "scoring_func": moe.score_func,
            "norm_topk_prob": moe.route_norm,
            "routed_scaling_factor": moe.route_scale,
            "n_group": moe.n_groups,
            "topk_group": moe.topk_groups,
            "num_nextn_predict_layers": 0,
        }

    def layer_shapes(self, cfg: DeepSeekV3Config, layer: int) -> dict[str, tuple[int, ...]]:
        mla, dim, heads = cfg.mla, cfg.dim, cfg.n_heads
        shapes: dict[str, tuple[int, ...]] = {"attention_norm.weight": (dim,), "ffn_norm.weight": (dim,)}
        if mla.q_lora_rank:
            shapes["attention.wq_a.weight"] = (mla.q_lora_rank, dim)
            shapes["attention.q_norm.weight"] = (mla.q_lora_rank,)
            shapes["attention.wq_b.weight"] = (heads * mla.qk_head_dim, mla.q_lora_rank)
        else:
            shapes["attention.wq.weight"] = (heads * mla.qk_head_dim, dim)
        shapes["attention.wkv_a.weight"] = (mla.kv_lora_rank + mla.qk_rope_head_dim, dim)
        shapes["attention.kv_norm.weight"] = (mla.kv_lora_rank,)
        shapes["attention.wkv_b.weight"] = (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        shapes["attention.wo.weight"] = (dim, heads * mla.v_head_dim)
        if not cfg.is_moe_layer(layer):
            ffn = cfg.ffn_hidden_dim
            return {**shapes, "feed_forward.w1.weight": (ffn, dim), "feed_forward.w2.weight": (dim, ffn),
                    "feed_forward.w3.weight": (ffn, dim)}  # fmt: skip
        moe = cfg.moe
        experts, hidden, shared = moe.num_experts, moe.hidden_dim, moe.num_shared_experts * moe.hidden_dim
        shapes |= {"moe.router.gate.weight": (experts, dim), "moe.router.expert_bias": (experts,)}
        shapes |= {"moe.experts.w1": (experts, hidden, dim), "moe.experts.w3": (experts, hidden, dim),
                   "moe.experts.w2": (experts, dim, hidden)}  # fmt: skip
        if shared:
            shapes |= {"moe.shared.w1.weight": (shared, dim), "moe.shared.w3.weight": (shared, dim),
                       "moe.shared.w2.weight": (dim, shared)}  # fmt: skip
        return shapes

"""Qwen3, dense (`Qwen3ForCausalLM`) and mixture-of-experts (`Qwen3MoeForCausalLM`), in Hugging
Face's format, torch-free (models/hf.py). Llama's format (models/llama3/hf_format.py) and what
Qwen3 adds: heads of their own width (head_dim), q/k norms over each head (whose weights, like the
q/k rows, HF orders for its rotate-half rotary embedding), and the experts: the router
(`mlp.gate`), one tensor per expert as the published checkpoints hold them
(`mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`, what this project writes), or the fused
pair transformers writes with save_original_format=False (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`)."""

from titan_exp.models.common.moe.config import MoEConfig
from titan_exp.models.config import ModelConfig
from titan_exp.models.hf import hf_aux_loss_coeff, hf_aux_loss_config, hf_num_experts, hf_value
from titan_exp.models.llama3.hf_format import LlamaFormat


class Qwen3Format(LlamaFormat):
    model_types = ("qwen3", "qwen3_moe")
    layer_keys = {
        **LlamaFormat.layer_keys,
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
        "moe.router.gate.weight": "mlp.gate.weight",
    }
    compared = (
        *LlamaFormat.compared,
        "head_dim",
        "moe.num_experts",
        "moe.top_k",
        "moe.hidden_dim",
        "moe.n_dense_layers",
        "moe.route_norm",
    )
    compared_keys = {**LlamaFormat.compared_keys, "head_dim": "attention_head_dim"}
    heads_own_width = True

    def fields_from_hf(self, hf: dict, refuse) -> dict[str, object]:
        if hf_value(hf, "use_sliding_window", bool, refuse, False):
            raise refuse("use_sliding_window=true; attention here is full causal attention in every layer")
        fields = super().fields_from_hf(hf, refuse)
        if hf.get("model_type") != "qwen3_moe":
            return fields
        return {**fields, "moe": self._moe_fields(hf, refuse)}

    @staticmethod
    def _moe_fields(hf: dict, refuse) -> MoEConfig:
        """Qwen3-MoE's experts; its dense layers (mlp_only_layers) must be the first ones, as here."""
        if hf_value(hf, "decoder_sparse_step", int, refuse, 1) != 1:
            raise refuse("decoder_sparse_step other than 1; here every layer after the dense ones is MoE")
        dense = hf_value(hf, "mlp_only_layers", list, refuse, [])
        if dense != list(range(len(dense))):
            raise refuse(f"mlp_only_layers={str(dense)[:40]}; here the dense layers are the first ones (0, 1, ...)")
        return MoEConfig(
            num_experts=hf_num_experts(hf, refuse),
            top_k=hf_value(hf, "num_experts_per_tok", int, refuse),
            hidden_dim=hf_value(hf, "moe_intermediate_size", int, refuse),
            n_dense_layers=len(dense),
            route_norm=hf_value(hf, "norm_topk_prob", bool, refuse, False),
            aux_loss_coeff=hf_aux_loss_coeff(hf, refuse),
        )

    def refusal(self, cfg: ModelConfig) -> str | None:
        moe = cfg.moe
        if moe.enabled and (moe.num_shared_experts or moe.score_func != "softmax" or moe.n_groups != 1):
            return "Qwen3MoeForCausalLM routes by softmax, ungrouped, without shared experts"
        if moe.enabled and (moe.route_scale != 1.0 or moe.load_balance_coeff is not None):
            return "Qwen3MoeForCausalLM neither scales the routed output nor biases the choice"
        if moe.enabled and (moe.bias or moe.swiglu_limit is not None):
            return "Qwen3MoeForCausalLM's experts are SwiGLUs without biases or clamps"
        return None

    def permuted_heads(self, name: str, cfg: ModelConfig) -> int | None:
        if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            return 1  # one head's channels
        return super().permuted_heads(name, cfg)

    def hf_config(self, cfg: ModelConfig, dtype: str) -> dict:
        config = {**super().hf_config(cfg, dtype), "head_dim": cfg.head_dim, "use_sliding_window": False}
        if not cfg.moe.enabled:
            return {**config, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
        moe = cfg.moe
        return {
            **config,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.hidden_dim,
            "mlp_only_layers": list(range(moe.n_dense_layers)),
            "decoder_sparse_step": 1,
            "norm_topk_prob": moe.route_norm,
            **hf_aux_loss_config(moe.aux_loss_coeff),
        }

    def layer_shapes(self, cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
        shapes = super().layer_shapes(cfg, layer)
        shapes["attention.q_norm.weight"] = shapes["attention.k_norm.weight"] = (cfg.head_dim,)
        if cfg.is_moe_layer(layer):
            for name in ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"):
                del shapes[name]
            experts, hidden = cfg.moe.num_experts, cfg.moe.hidden_dim
            shapes["moe.router.gate.weight"] = (experts, cfg.dim)
            shapes["moe.experts.w1"] = shapes["moe.experts.w3"] = (experts, hidden, cfg.dim)
            shapes["moe.experts.w2"] = (experts, cfg.dim, hidden)
        return shapes

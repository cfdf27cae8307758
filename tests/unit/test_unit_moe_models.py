"""Qwen3 (dense and mixture-of-experts), DeepSeek-V3 (latent attention, YaRN, grouped sigmoid
routing, shared experts) and GPT-OSS: parameter counts held to `transformers`' own models on the meta device
and to the counts the option files state, YaRN's frequencies to transformers', FLOPs on the active
parameters, and the MoE layer held to a token-by-token reference."""

import dataclasses
import re

import pytest
import torch
import transformers

from titan_exp import CONF_DIR
from titan_exp.config.compose import compose_job_config
from titan_exp.config.resolve import resolve
from titan_exp.estimate.gpu_compute import gpu_compute
from titan_exp.estimate.memory import rank_memory
from titan_exp.estimate.step_time import step_time
from titan_exp.estimate.workload import inactive_parameters, model_parameters
from titan_exp.job.memory import workload
from titan_exp.metrics.flops import flops_per_token
from titan_exp.models.common.moe.config import MoEConfig
from titan_exp.models.common.moe.layer import MoE
from titan_exp.models.common.rotary import precompute_freqs_cis
from titan_exp.models.registry import build_model
from titan_exp.rules import ConfigError

QWEN3 = ("qwen3_debug", "qwen3_moe_debug", "qwen3_0.6b", "qwen3_8b", "qwen3_30b_a3b", "qwen3_235b_a22b")
# Qwen's model cards: (total, active) in billions, to the digits they give.
PUBLISHED = {
    "qwen3_0.6b": (0.6, 0.6),
    "qwen3_8b": (8.2, 8.2),
    "qwen3_30b_a3b": (30.5, 3.3),
    "qwen3_235b_a22b": (235, 22),
    "deepseek_v3_671b": (671, 37),
    # OpenAI's gpt-oss model card.
    "gpt_oss_20b": (21, 3.6),
    "gpt_oss_120b": (117, 5.1),
}
DEEPSEEK_V3 = ("deepseek_v3_debug", "deepseek_v3_16b", "deepseek_v3_671b")
GPT_OSS = ("gpt_oss_debug", "gpt_oss_20b", "gpt_oss_120b")


def transformers_qwen3(flavor: str) -> torch.nn.Module:
    m = compose_job_config([f"model={flavor}"]).model
    shape = dict(
        hidden_size=m.dim,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.kv_heads,
        head_dim=m.head_dim,
        vocab_size=m.vocab_size,
        tie_word_embeddings=m.tie_word_embeddings,
    )
    if m.moe.enabled:
        moe = dict(
            num_experts=m.moe.num_experts, num_experts_per_tok=m.moe.top_k, moe_intermediate_size=m.moe.hidden_dim
        )
        config = transformers.Qwen3MoeConfig(**shape, **moe, decoder_sparse_step=1, mlp_only_layers=[])
        model_class = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.Qwen3Config(**shape, intermediate_size=m.ffn_hidden_dim)
        model_class = transformers.Qwen3ForCausalLM
    with torch.device("meta"):
        return model_class(config)


def transformers_deepseek_v3(flavor: str) -> torch.nn.Module:
    m = compose_job_config([f"model={flavor}"]).model
    config = transformers.DeepseekV3Config(
        hidden_size=m.dim,
        intermediate_size=m.ffn_hidden_dim,
        moe_intermediate_size=m.moe.hidden_dim,
        num_hidden_layers=m.n_layers,
        first_k_dense_replace=m.moe.n_dense_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_heads,
        n_routed_experts=m.moe.num_experts,
        n_shared_experts=m.moe.num_shared_experts,
        num_experts_per_tok=m.moe.top_k,
        n_group=m.moe.n_groups,
        topk_group=m.moe.topk_groups,
        kv_lora_rank=m.mla.kv_lora_rank,
        q_lora_rank=m.mla.q_lora_rank or None,
        qk_nope_head_dim=m.mla.qk_nope_head_dim,
        qk_rope_head_dim=m.mla.qk_rope_head_dim,
        v_head_dim=m.mla.v_head_dim,
        vocab_size=m.vocab_size,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return transformers.DeepseekV3ForCausalLM(config)


def transformers_gpt_oss(flavor: str) -> torch.nn.Module:
    m = compose_job_config([f"model={flavor}"]).model
    config = transformers.GptOssConfig(
        hidden_size=m.dim,
        intermediate_size=m.moe.hidden_dim,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.kv_heads,
        head_dim=m.head_dim,
        num_local_experts=m.moe.num_experts,
        num_experts_per_tok=m.moe.top_k,
        vocab_size=m.vocab_size,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return transformers.GptOssForCausalLM(config)


def transformers_model(flavor: str) -> torch.nn.Module:
    if flavor in DEEPSEEK_V3:
        return transformers_deepseek_v3(flavor)
    return transformers_gpt_oss(flavor) if flavor in GPT_OSS else transformers_qwen3(flavor)


def stated_counts(flavor: str) -> list[int]:
    """The parameter counts the option file's leading comment states (total, then active if given)."""
    lines = (CONF_DIR / "model" / f"{flavor}.yaml").read_text().splitlines()
    comment = " ".join(line for line in lines if line.startswith("#"))
    return [int(n.replace(",", "")) for n in re.findall(r"\d{1,3}(?:,\d{3})+", comment)]


@pytest.mark.parametrize("flavor", QWEN3 + DEEPSEEK_V3 + GPT_OSS)
def test_parameter_counts_agree_with_transformers_and_the_option_file(flavor):
    m = compose_job_config([f"model={flavor}"]).model
    with torch.device("meta"):
        ours = build_model(m).num_params()
    built = transformers_model(flavor)
    theirs = sum(p.numel() for p in built.parameters())
    assert ours == theirs == model_parameters(m)
    stated = stated_counts(flavor)
    assert stated[0] == ours
    if m.moe.enabled:
        assert stated[1] == ours - inactive_parameters(m)


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_counts_round_to_the_published_sizes(flavor):
    m = compose_job_config([f"model={flavor}"]).model
    total, active = model_parameters(m), model_parameters(m) - inactive_parameters(m)
    if flavor in GPT_OSS:  # OpenAI's active counts leave the input embedding out
        active -= m.vocab_size * m.dim
    # Within the last digit given (3,353,032,704 active is Qwen's "3.3B", 116.8B OpenAI's "117B").
    for count, published in zip((total, active), PUBLISHED[flavor]):
        assert count / 1e9 == pytest.approx(published, abs=1 if float(published).is_integer() else 0.1)


def test_moe_flops_count_the_experts_a_token_goes_through():
    m = compose_job_config(["model=qwen3_30b_a3b"]).model
    n, embedding = model_parameters(m), m.vocab_size * m.dim
    attention = 12 * m.n_layers * m.n_heads * m.head_dim * 4096
    assert flops_per_token(m, n, embedding, 4096) == 6 * (n - inactive_parameters(m) - embedding) + attention
    # 8 of 128 experts: about a tenth of the dense count.
    assert flops_per_token(m, n, embedding, 4096) < 0.15 * (6 * (n - embedding) + attention)


def reference_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the router's choice, each chosen expert's SwiGLU, summed with its weight."""
    cfg, experts = layer.cfg, layer.experts
    logits = layer.router.gate(x).float()
    scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = scores[t].topk(cfg.top_k).indices
        weights = scores[t, chosen] / (scores[t, chosen].sum() if cfg.route_norm else 1)
        for e, w in zip(chosen.tolist(), weights):
            hidden = torch.nn.functional.silu(experts.w1[e] @ x[t]) * (experts.w3[e] @ x[t])
            out[t] += cfg.route_scale * w * (experts.w2[e] @ hidden)
    return out + (layer.shared(x) if layer.shared is not None else 0)


@pytest.mark.parametrize(
    "cfg",
    [
        MoEConfig(num_experts=8, top_k=2, hidden_dim=16),
        MoEConfig(num_experts=8, top_k=3, hidden_dim=16, score_func="sigmoid", route_scale=2.5, num_shared_experts=1),
    ],
    ids=["softmax", "sigmoid_shared"],
)
def test_the_moe_layer_equals_a_token_by_token_reference(cfg):
    torch.manual_seed(0)
    layer = MoE(32, cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 24, 32)
    out = layer(x)
    torch.testing.assert_close(out.view(-1, 32), reference_moe(layer, x.view(-1, 32)), rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0  # the routing weights train


def test_grouped_routing_keeps_each_token_within_its_best_groups():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_dim=4, score_func="sigmoid", n_groups=4, topk_groups=1)
    layer = MoE(16, cfg)
    torch.nn.init.normal_(layer.router.gate.weight)
    tokens = torch.randn(64, 16)
    _, experts, _ = layer.router(tokens)
    scores = layer.router.gate(tokens).sigmoid().view(64, 4, 2)
    best_group = scores.topk(2, dim=-1).values.sum(-1).argmax(-1)
    assert (experts // 2 == best_group.unsqueeze(-1)).all()  # both experts from the one best group


def test_a_dry_runs_fake_tokens_are_routed_evenly():
    """Fake tensors (COMM_MODE=fake_backend, the planner's measured pass) hold no routing to count:
    the layer runs on them, its shapes those of a balanced routing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        layer = MoE(32, MoEConfig(num_experts=8, top_k=2, hidden_dim=16))
        out = layer(torch.empty(2, 10, 32))
    assert out.shape == (2, 10, 32)


def test_yarn_frequencies_are_transformers():
    """DeepSeek-V3's rotary frequencies (YaRN, factor 40 over 4,096 positions) as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    m = compose_job_config(["model=deepseek_v3_671b"]).model
    scaling = dict(factor=40.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    config = transformers.DeepseekV3Config(
        qk_rope_head_dim=m.mla.qk_rope_head_dim,
        rope_theta=m.rope_theta,
        max_position_embeddings=m.max_seq_len,
        rope_scaling={"rope_type": "yarn", **scaling, "original_max_position_embeddings": 4096},
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = precompute_freqs_cis(m, 2)[1].angle()  # position 1: the frequencies themselves
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=1e-7)


def test_the_bias_moves_each_expert_toward_the_mean_load():
    """DeepSeek-V3's balancing: an expert that got more than the mean is picked less after the
    step, one that got fewer more; the load counted is the training forwards' only."""
    from titan_exp.models.common.moe.balance import ExpertBalance

    cfg = compose_job_config(["model=deepseek_v3_debug"]).model
    model = build_model(cfg)
    model.init_weights(seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens)  # a validation forward: not counted
    assert all(m.tokens_per_expert.sum() == 0 for m in model.modules() if isinstance(m, MoE))
    model(tokens)
    layer = model.layers["1"].moe
    load = layer.tokens_per_expert.clone()
    assert load.sum() == 2 * 64 * cfg.moe.top_k
    balance = ExpertBalance([model], cfg, torch.device("cpu"))
    metrics = balance.after_step()
    assert balance.load_by_layer()[1] == load.tolist()  # the run's plot: the load summed over its steps
    assert 0 not in balance.load_by_layer()  # a dense first layer has no experts
    bias = layer.router.expert_bias
    assert (bias[load > load.mean()] < 0).all() and (bias[load < load.mean()] > 0).all()
    assert bias.abs().max() == cfg.moe.load_balance_coeff
    assert metrics["moe/load_imbalance/layer_1"] == pytest.approx((load.max() / load.mean()).item())
    assert layer.tokens_per_expert.sum() == 0  # counted afresh each step


@pytest.mark.parametrize("over", ["all_layers", "each_layer"])
def test_the_auxiliary_loss_is_transformers_pooled_or_one_per_layer(over):
    """With 4 MoE layers: all_layers is transformers' load_balancing_loss_func (Qwen3-MoE's) of every
    layer's router logits pooled, times model.moe.aux_loss_coeff; each_layer the same function of
    each layer's alone, summed (4× the pooled one at a balanced start). Both as the moe/aux_loss
    metric, and in every router's gradient: ours with the loss built in equals the model without
    it whose loss adds transformers' function of the same router logits (through the same graph)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from titan_exp.models.common.moe.balance import ExpertBalance

    cfg = compose_job_config(["model=qwen3_moe_debug", f"model.moe.aux_loss_over={over}"]).model
    coeff, experts, top_k = cfg.moe.aux_loss_coeff, cfg.moe.num_experts, cfg.moe.top_k
    assert cfg.num_moe_layers == 4
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))

    def transformers_aux_loss(router_logits: list[torch.Tensor]) -> torch.Tensor:
        if over == "all_layers":
            return coeff * load_balancing_loss_func(tuple(router_logits), experts, top_k)
        return coeff * sum(load_balancing_loss_func((layer,), experts, top_k) for layer in router_logits)

    grads = {}
    for built_in in (True, False):
        moe = dataclasses.replace(cfg.moe, aux_loss_coeff=coeff if built_in else None)
        model = build_model(dataclasses.replace(cfg, moe=moe))
        model.init_weights(seed=0)
        gates = [model.layers[str(i)].moe.router.gate for i in range(4)]
        router_logits = []
        for gate in gates:
            gate.register_forward_hook(lambda module, inputs, output, kept=router_logits: kept.append(output))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        if built_in:
            loss.backward()
            metrics = ExpertBalance([model], model.cfg, torch.device("cpu")).after_step()
        else:
            reference = transformers_aux_loss(router_logits)
            (loss + reference).backward()
        grads[built_in] = [gate.weight.grad for gate in gates]
    assert metrics["moe/aux_loss"] == pytest.approx(reference.item(), rel=1e-5)
    assert reference.item() / coeff == pytest.approx(top_k * (4 if over == "each_layer" else 1), rel=0.1)
    for ours, theirs in zip(grads[True], grads[False]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-10)


def test_the_pooled_auxiliary_loss_is_refused_under_a_pipeline():
    with pytest.raises(ConfigError, match="^model.moe.aux_loss_over=all_layers: pools every layer's routing"):
        resolve(compose_job_config(["model=qwen3_moe_debug", "parallelism=pp", "launcher.nproc_per_node=2",
                                    "launcher.device=cpu", "training.local_batch_size=4"]))  # fmt: skip


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["swiglu", "biased_clamped_swiglu"])
def test_the_grouped_gemm_equals_one_matmul_per_expert(gpt_oss):
    """torch's grouped GEMM (CUDA bfloat16 in training; its CPU fallback here, float32) over rows
    padded per expert gives each row its own expert's output and gradients, empty experts included;
    GPT-OSS's experts (biases, the clamped SwiGLU) too."""
    from titan_exp.models.common.moe.grouped_mm import grouped_swiglu

    generator = torch.Generator().manual_seed(0)
    extra = {"bias": True, "swiglu_limit": 2.0} if gpt_oss else {}
    layer = MoE(16, MoEConfig(num_experts=4, top_k=1, hidden_dim=32, **extra))
    experts = layer.experts
    params = list(experts.parameters())
    for p in params:
        torch.nn.init.normal_(p, generator=generator)
    counts = [3, 0, 21, 5]
    rows = torch.randn(sum(counts), 16, generator=generator, requires_grad=True)
    biases = (experts.w1_bias, experts.w2_bias, experts.w3_bias) if gpt_oss else None
    grouped = grouped_swiglu(rows, counts, experts.w1, experts.w2, experts.w3, experts.activation, biases)
    grouped.square().sum().backward()
    grads = [t.grad.clone() for t in (rows, *params)]
    for t in (rows, *params):
        t.grad = None
    looped = experts._run(rows, counts)  # the loop: CPU rows
    looped.square().sum().backward()
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-4)
    for mine, theirs in zip(grads, (rows.grad, *(p.grad for p in params))):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-3)


def test_the_load_imbalance_stretches_a_layout_only_under_expert_parallelism():
    """plan.expert_load_imbalance is the busiest EP rank's rows over the mean rank's: without EP a
    rank runs exactly its own tokens' rows, so a sweep over EP degrees stretches only its EP points
    (their step and memory), whatever the setting."""
    base = ["model=deepseek_v3_16b", "hardware=h100", "launcher.nproc_per_node=8",
            "parallelism.data_parallel_shard_degree=8", "training.mixed_precision_param=bfloat16"]  # fmt: skip

    def planned(*overrides: str) -> tuple[float, float]:
        cfg = compose_job_config([*base, *overrides])
        w = workload(cfg, "cuda")
        return step_time(w, cfg.hardware, gpu_compute(w, cfg.hardware)).total, rank_memory(w).total

    skewed = "plan.expert_load_imbalance=1.5"
    assert planned(skewed) == planned()
    with_ep = "parallelism.expert_parallel_degree=8"
    assert all(s > b for s, b in zip(planned(with_ep, skewed), planned(with_ep)))

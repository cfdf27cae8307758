"""Small random Hugging Face checkpoints of each family the tests save with `transformers` (their
configs' shapes), and the quantized forms the published checkpoints store: DeepSeek-V3's float8
weights with a scale per block, GPT-OSS's MXFP4 experts. The families' tests
(tests/test_hf_*.py) and every layout's (tests/test_hf_layouts.py) build from them."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

QWEN3_SHAPE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # wider than hidden_size / heads, as Qwen3's are
    vocab_size=320,
    max_position_embeddings=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # logits far from uniform: a wrongly ordered weight shows
    tie_word_embeddings=False,
)
QWEN3_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0]
)

DEEPSEEK_V3_SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    routed_scaling_factor=2.5,
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    initializer_range=0.1,
    tie_word_embeddings=False,
)

# DeepSeek-V3's float8 checkpoints scale each FLOAT8_BLOCK × FLOAT8_BLOCK block of a weight.
FLOAT8_BLOCK = 16


def float8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3 weight, float32 scale_inv per block, the blocks at the edges partial), as
    DeepSeek-V3's checkpoints hold them."""
    rows, cols = weight.shape
    block = FLOAT8_BLOCK
    padded = torch.nn.functional.pad(weight, (0, -cols % block, 0, -rows % block))
    blocks = padded.reshape(padded.shape[0] // block, block, padded.shape[1] // block, block)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    return (weight / spread_blocks(scale_inv, rows, cols)).to(torch.float8_e4m3fn), scale_inv


def spread_blocks(scale_inv: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return scale_inv.repeat_interleave(FLOAT8_BLOCK, 0).repeat_interleave(FLOAT8_BLOCK, 1)[:rows, :cols]


def float8_copy(source: Path, folder: Path) -> Path:
    """`source`'s weights as the published DeepSeek-V3 stores them: each projection in float8 e4m3
    with a float32 scale per block (`weight_scale_inv`)."""
    folder.mkdir()
    config = json.loads((source / "config.json").read_text())
    block = [FLOAT8_BLOCK, FLOAT8_BLOCK]
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block}
    (folder / "config.json").write_text(json.dumps(config))
    stored = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if tensor.dim() == 2 and "proj" in name:
            weight, scale_inv = float8_blocks(tensor.float())
            stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"] = weight, scale_inv
        else:
            stored[name] = tensor
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


GPT_OSS_SHAPE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=64,  # MXFP4 packs 32 values a block along the inputs: 64 and 64
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,  # binds: queries beyond it see only their last 8 keys
    max_position_embeddings=40,
    swiglu_limit=1.5,  # low enough that the clamps bind on random weights
    tie_word_embeddings=False,
)


def mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 `_blocks` (…, blocks, 16 bytes) and `_scales` (…, blocks) of a tensor of `shape`
    (experts × out × in, the published orientation): every code, exponents around 2^0."""
    *outer, cols = shape
    codes = torch.randint(0, 256, (*outer, cols // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(124, 130, (*outer, cols // 32), generator=generator).to(torch.uint8)
    return codes, scales

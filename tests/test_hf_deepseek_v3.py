"""DeepSeek-V3 weights in, through `transformers` itself: a random DeepseekV3ForCausalLM (latent
attention with a q latent, YaRN, a dense layer then MoE layers with a shared expert, grouped
sigmoid routing with its selection bias) saved by transformers, experts one tensor each and fused,
is read by `model=hf` and loaded into our model with transformers' logits; the same weights
stored as the published checkpoints store them (float8 e4m3, a float32 `weight_scale_inv` per
block) load dequantized, equal to the dequantized weights; out, the export opens in transformers
(tests/test_hf_qwen3.py runs the multi-rank path the families share)."""

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from titan_exp.checkpoint.hf import load_hf
from titan_exp.checkpoint.safetensors_folder import SafetensorsFolder
from titan_exp.models.registry import FAMILIES, build_model, config_from_hf, hf_cautions

from hf_checkpoints import DEEPSEEK_V3_SHAPE, float8_copy, spread_blocks

SEQ = 24
VOCAB = DEEPSEEK_V3_SHAPE["vocab_size"]


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def our_logits(folder: Path) -> torch.Tensor:
    cfg = config_from_hf(str(folder), "model.hf_path")
    model = build_model(cfg)
    model.init_weights(seed=1)
    load_hf(model, str(folder), cfg)
    with torch.no_grad():
        return model(tokens())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("deepseek")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK_V3_SHAPE))
    with torch.no_grad():  # a selection bias of zeros would hide one read wrongly
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    model.save_pretrained(tmp / "per-expert")
    model.save_pretrained(tmp / "fused", save_original_format=False)
    with torch.no_grad():
        logits = model(tokens()).logits
    return {"per-expert": tmp / "per-expert", "fused": tmp / "fused", "logits": logits, "tmp": tmp}


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_our_model_loaded_from_the_folder_gives_transformers_logits(saved, layout):
    cfg = config_from_hf(str(saved[layout]), "model.hf_path")
    assert cfg.name == "deepseek_v3" and cfg.mla.q_lora_rank == 32 and cfg.moe.n_dense_layers == 1
    assert cfg.rope_scaling_type == "yarn" and cfg.moe.load_balance_coeff is not None
    torch.testing.assert_close(our_logits(saved[layout]), saved["logits"], rtol=1e-5, atol=1e-5)
    # The config names a multi-token-prediction layer (transformers' default, 1): said, not read.
    assert hf_cautions(str(saved[layout])) == [
        "its 1 multi-token-prediction layer(s) (model.layers.2+) are not read: no MTP here"
    ]


def test_float8_weights_with_block_scales_load_dequantized(saved):
    """Every 2-D projection (not the embeddings, norms, routers or output) in float8 with its
    block scales; the float32 folder beside it holds the same weights dequantized by hand."""
    source = saved["per-expert"]
    fp8, dequantized = float8_copy(source, saved["tmp"] / "fp8"), saved["tmp"] / "dequantized"
    stored, plain = load_file(fp8 / "model.safetensors"), {}
    for name, tensor in stored.items():
        if tensor.dtype == torch.float8_e4m3fn:
            scale_inv = stored[name.removesuffix("weight") + "weight_scale_inv"]
            plain[name] = tensor.float() * spread_blocks(scale_inv, *tensor.shape)
        elif not name.endswith("weight_scale_inv"):
            plain[name] = tensor
    dequantized.mkdir()
    shutil.copy(source / "config.json", dequantized / "config.json")
    save_file(plain, dequantized / "model.safetensors", metadata={"format": "pt"})
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values())
    torch.testing.assert_close(our_logits(fp8), our_logits(dequantized), rtol=0, atol=0)
    # A rank's box starts and ends anywhere in a block (FSDP's rows, TP's columns): each equals
    # that part of the whole dequantized weight.
    folder = SafetensorsFolder(str(fp8))
    generator = torch.Generator().manual_seed(1)
    for name in [n for n in plain if n in stored and stored[n].dtype == torch.float8_e4m3fn]:
        rows, cols = plain[name].shape
        for _ in range(3):
            r0, c0 = (int(torch.randint(0, n - 1, (), generator=generator)) for n in (rows, cols))
            r1, c1 = (int(torch.randint(a + 1, n + 1, (), generator=generator)) for a, n in ((r0, rows), (c0, cols)))
            box = (slice(r0, r1), slice(c0, c1))
            torch.testing.assert_close(folder.read(name, box), plain[name][box], rtol=0, atol=0, msg=name)
    # The rounding is real: the float8 model is not the float32 one it came from.
    assert not torch.allclose(our_logits(fp8), saved["logits"], atol=1e-4)


def test_our_config_json_is_one_transformers_builds_the_same_model_from(saved):
    """Written back: our config.json (the export's) of the folder's model gives transformers' model."""
    cfg = config_from_hf(str(saved["per-expert"]), "model.hf_path")
    config = transformers.DeepseekV3Config.from_dict(FAMILIES["deepseek_v3"].hf.hf_config(cfg, "float32"))
    with torch.device("meta"):
        theirs = transformers.DeepseekV3ForCausalLM(config)
    shapes = {name: tuple(p.shape) for name, p in theirs.state_dict().items()}
    assert shapes == FAMILIES["deepseek_v3"].hf.expected_shapes(cfg, fused=True)

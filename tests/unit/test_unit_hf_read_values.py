"""What the ranks read of a Hugging Face folder (checkpoint/safetensors_folder.py), on real
safetensors files: a weight that is not finite (NaN, inf, an MXFP4 block whose scale makes it inf)
is refused when read, naming the tensor and where, before the first step, rather than training
until the loss is NaN (issue 68: an inf row of the embedding trained to the end); float8 scales
are read by index, so a block of any size costs no more memory than the box read."""

import json
import resource
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for crafted.py

from titan_exp.checkpoint.hf import load_hf  # noqa: E402
from titan_exp.checkpoint.safetensors_folder import SafetensorsFolder  # noqa: E402
from titan_exp.models.registry import build_model, config_from_hf  # noqa: E402

from crafted import TINY_TENSORS, tiny_gpt_oss_mxfp4, tiny_llama  # noqa: E402


def _llama_with(folder: Path, name: str, where: tuple, value: float, dtype: torch.dtype) -> Path:
    """The tiny Llama with random weights in `dtype` but `value` at `where` of tensor `name`."""
    tiny_llama(folder, tensors=False)
    generator = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(shape, generator=generator).to(dtype) for n, shape in TINY_TENSORS.items()}
    tensors[name][where] = value
    save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize(
    "name, where, value, dtype, said",
    [
        ("model.embed_tokens.weight", (7,), float("inf"), torch.float32, "holds inf at [7, 0]"),
        ("model.layers.0.self_attn.q_proj.weight", (3, 5), float("nan"), torch.bfloat16, "holds nan at [3, 5]"),
        ("model.norm.weight", (15,), float("-inf"), torch.bfloat16, "holds -inf at [15]"),
    ],
)
def test_a_weight_that_is_not_finite_is_refused_when_loaded_naming_it(tmp_path, name, where, value, dtype, said):
    folder = str(_llama_with(tmp_path / "hf", name, where, value, dtype))
    cfg = config_from_hf(folder, "model.hf_path")
    model = build_model(cfg)
    model.init_weights(seed=1)
    with pytest.raises(ValueError) as refused:
        load_hf(model, folder, cfg)
    fix = "weights must be finite (the file is damaged: fetch it again)"
    assert str(refused.value) == f"{folder}: {name} {said}; {fix}"


def test_finite_weights_load_as_they_are(tmp_path):
    """The check passes what is finite, the largest float32 included (the same folder with it there)."""
    largest = torch.finfo(torch.float32).max
    folder = str(_llama_with(tmp_path / "hf", "model.embed_tokens.weight", (7,), largest, torch.float32))
    cfg = config_from_hf(folder, "model.hf_path")
    model = build_model(cfg)
    load_hf(model, folder, cfg)
    assert model.tok_embeddings.weight[7].tolist() == [largest] * 16


def test_an_mxfp4_scale_of_255_is_refused_by_the_ranks_reader_too(tmp_path):
    """Scale byte 255 (NaN in the MX format) read as 2^128: the block's values inf, refused
    naming the fused tensor and the first of them (the launching process refuses it first:
    tests/crafted.py's 'MXFP4 scale 255')."""
    name = "model.layers.1.mlp.experts.gate_up_proj"
    blocks, scales = 2 * 64 * 16, 2 * 64  # experts × rows × (a block of 32 values: 16 bytes)
    data = {f"{name}_blocks": b"\x22" * blocks, f"{name}_scales": b"\x7f" * (scales - 1) + b"\xff"}
    reader = SafetensorsFolder(str(tiny_gpt_oss_mxfp4(tmp_path / "hf", data=data)))
    assert reader.read_mxfp4(name, (slice(0, 1), slice(0, 64), slice(0, 32))).unique().tolist() == [1.0]
    with pytest.raises(ValueError, match=rf": {name} holds inf at \[1, 63, 0\]; weights must be finite"):
        reader.read_mxfp4(name, (slice(0, 2), slice(0, 64), slice(0, 32)))


def _float8_folder(folder: Path, weight: torch.Tensor, scale_inv: torch.Tensor, block: list[int]) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": block}}))
    stored = {"w.weight": weight.to(torch.float8_e4m3fn), "w.weight_scale_inv": scale_inv}
    save_file(stored, folder / "model.safetensors")
    return folder


def test_float8_boxes_take_their_blocks_scales(tmp_path):
    """Any box of a matrix in 16 × 16 blocks (partial at its edges) reads as its float8 values
    times its blocks' scales."""
    weight = torch.randn(40, 56, generator=torch.Generator().manual_seed(1)).to(torch.float8_e4m3fn)
    scale_inv = torch.arange(1, 13, dtype=torch.float32).reshape(3, 4)
    reader = SafetensorsFolder(str(_float8_folder(tmp_path / "hf", weight, scale_inv, [16, 16])))
    whole = weight.float() * scale_inv.repeat_interleave(16, 0).repeat_interleave(16, 1)[:40, :56]
    for rows, cols in ((slice(0, 40), slice(0, 56)), (slice(5, 37), slice(3, 20)), (slice(17, 17), slice(0, 8))):
        torch.testing.assert_close(reader.read("w.weight", (rows, cols)), whole[rows, cols], rtol=0, atol=0)


def test_a_block_wider_than_the_matrix_costs_no_more_than_the_box(tmp_path):
    """A 65,536 × 65,536 block (one scale for the whole matrix): the reader once spread each
    scale over its whole block (16 GiB for this one); now it reads the box, no more."""
    weight = torch.randn(32, 48, generator=torch.Generator().manual_seed(2)).to(torch.float8_e4m3fn)
    reader = SafetensorsFolder(str(_float8_folder(tmp_path / "hf", weight, torch.tensor([[0.5]]), [1 << 16, 1 << 16])))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    read = reader.read("w.weight", (slice(0, 32), slice(0, 48)))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before < 64 << 20
    torch.testing.assert_close(read, weight.float() * 0.5, rtol=0, atol=0)

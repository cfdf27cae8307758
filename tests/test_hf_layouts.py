"""Every family's Hugging Face checkpoint loaded and exported in every layout it trains in, on real
gloo ranks: random models made by transformers (Qwen3, Qwen3-MoE with one tensor per expert and
fused, DeepSeek-V3 stored as the published weights are, in float8 with block scales, GPT-OSS with
MXFP4 experts) are loaded by each rank of fsdp2, tp2, pp2 and fsdp2·ep2 reading only its boxes
(checkpoint/hf.py), and the gathered weights equal the single-device load bit for bit; each
layout's export, loaded back on one device, equals them too. The single-device load gives
transformers' logits and its export opens in transformers (tests/test_hf_qwen3.py,
test_hf_deepseek_v3.py, test_hf_gpt_oss.py): so does every layout's. Llama's layouts train from
and export to a folder end to end (tests/test_hf_weights.py)."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from launchers.rendezvous import free_port
from titan_exp.checkpoint.hf import load_hf, save_hf
from titan_exp.checkpoint.hf_export import ExportSources
from titan_exp.config.compose import compose_job_config
from titan_exp.models.common.transformer import canonical_name
from titan_exp.models.registry import build_model, config_from_hf
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.train.model_parts import build_model_parts, materialize

from hf_checkpoints import (
    DEEPSEEK_V3_SHAPE,
    GPT_OSS_SHAPE,
    QWEN3_MOE,
    QWEN3_SHAPE,
    float8_copy,
    mxfp4,
)

WORLD = 2
DENSE_LAYOUTS = {
    "fsdp2": ["parallelism=fsdp"],
    "tp2": ["parallelism=tp"],
    "pp2": ["parallelism=pp", "parallelism.pipeline_parallel_microbatch_size=1"],
}
MOE_LAYOUTS = {**DENSE_LAYOUTS, "fsdp2·ep2": ["parallelism=fsdp", "parallelism.expert_parallel_degree=2"]}
FOLDERS = {"qwen3": DENSE_LAYOUTS, "qwen3_moe": MOE_LAYOUTS, "qwen3_moe fused": MOE_LAYOUTS}
FOLDERS |= {"deepseek_v3 float8": MOE_LAYOUTS, "gpt_oss mxfp4": MOE_LAYOUTS}
CASES = [(folder, layout) for folder, layouts in FOLDERS.items() for layout in layouts]


def _mxfp4_copy(source: Path, folder: Path) -> Path:
    """`source` with its experts' matrices as GPT-OSS's published MXFP4 blocks and scales."""
    folder.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (folder / "config.json").write_text(json.dumps(config))
    stored, generator = {}, torch.Generator().manual_seed(2)
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            shape = (tensor.shape[0], tensor.shape[2], tensor.shape[1])
            stored[f"{name}_blocks"], stored[f"{name}_scales"] = mxfp4(shape, generator)
        else:
            stored[name] = tensor
    save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _save(model: torch.nn.Module, folder: Path, **kwargs) -> Path:
    torch.manual_seed(0)
    with torch.no_grad():  # transformers starts norms at one and biases at zero: a misread one would hide
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("norm.weight", "bias", "sinks")):
                tensor.uniform_(0.5, 1.5) if name.endswith("norm.weight") else tensor.uniform_(-0.05, 0.05)
    model.save_pretrained(folder, **kwargs)
    return folder


def _folders(tmp: Path) -> dict[str, Path]:
    torch.manual_seed(0)
    qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3_SHAPE))
    moe_config = transformers.Qwen3MoeConfig(**QWEN3_SHAPE, **QWEN3_MOE)
    qwen3_moe = transformers.Qwen3MoeForCausalLM(moe_config)
    deepseek = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK_V3_SHAPE))
    gpt_oss = transformers.GptOssForCausalLM(transformers.GptOssConfig(**GPT_OSS_SHAPE)).float()
    return {
        "qwen3": _save(qwen3, tmp / "qwen3"),
        "qwen3_moe": _save(qwen3_moe, tmp / "qwen3_moe"),
        "qwen3_moe fused": _save(qwen3_moe, tmp / "qwen3_moe_fused", save_original_format=False),
        "deepseek_v3 float8": float8_copy(_save(deepseek, tmp / "deepseek_v3"), tmp / "deepseek_v3_float8"),
        "gpt_oss mxfp4": _mxfp4_copy(_save(gpt_oss, tmp / "gpt_oss"), tmp / "gpt_oss_mxfp4"),
    }


def _whole_weights(parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every weight of every rank's parts, gathered whole (every rank takes part), by canonical name."""
    mine = {}
    for part in parts:
        for name, tensor in part.state_dict().items():
            mine[canonical_name(name)] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).clone()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: tensor for weights in everyone for name, tensor in weights.items()}


def _ranks(rank: int, port: int, folders: dict[str, Path], out: Path, results: dict) -> None:
    """Each case in turn in one world: load the folder in the layout, gather the weights (rank 0
    keeps them in `results`), export to `out`/<folder>/<layout>."""
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        for folder, layout in CASES:
            try:
                cfg = compose_job_config(
                    [*FOLDERS[folder][layout], "model=hf", f"model.hf_path={folders[folder]}",
                     f"checkpoint.initial_load_path={folders[folder]}", "checkpoint.initial_load_in_hf=true",
                     "training.mixed_precision_param=float32"]
                )  # fmt: skip
                cfg.model = config_from_hf(str(folders[folder]), "model.hf_path")
                dims = ParallelDims.resolve(cfg.parallelism, WORLD)
                for key, degree in dims.degrees().items():  # as the job's resolution writes them
                    setattr(cfg.parallelism, key, degree)
                mesh = ParallelMesh(dims, "cpu")
                parts = build_model_parts(cfg, mesh, torch.device("cpu"))
                materialize(parts, cfg, torch.device("cpu"))
                weights = _whole_weights(parts.parts)
                export = out / folder / layout
                save_hf(parts.parts, export, cfg.model, rank == 0, torch.float32, ExportSources(None, None))
                dist.barrier()
            except Exception as err:
                err.add_note(f"in {folder} {layout}")  # the other rank ends with it
                raise
            if rank == 0:
                results[folder, layout] = {"weights": weights, "export": export}
    finally:
        dist.destroy_process_group()


def _single_device_load(folder: Path) -> dict[str, torch.Tensor]:
    cfg = config_from_hf(str(folder), "model.hf_path")
    model = build_model(cfg)
    model.init_weights(seed=1)  # overwritten by the load
    load_hf(model, str(folder), cfg)
    return dict(model.state_dict())


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hf_layouts")
    folders = _folders(tmp)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_ranks, args=(free_port(), folders, tmp / "exports", results), nprocs=WORLD, join=True)
        found = dict(results)
    return {"folders": folders, "single": {name: _single_device_load(f) for name, f in folders.items()}, **found}


@pytest.mark.slow  # one 2-rank world loads and exports every case (about 15 s)
@pytest.mark.parametrize("folder, layout", CASES, ids=[f"{f}·{layout}" for f, layout in CASES])
def test_each_layout_loads_the_single_device_weights_and_exports_them(loaded, folder, layout):
    single, found = loaded["single"][folder], loaded[folder, layout]
    assert found["weights"].keys() == single.keys()
    for name, tensor in single.items():
        torch.testing.assert_close(found["weights"][name], tensor, rtol=0, atol=0, msg=name)
    exported = _single_device_load(found["export"])
    for name, tensor in single.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=f"export: {name}")
    if "float8" in folder or "mxfp4" in folder:  # the quantized folder loads, and is exported, dequantized
        assert not json.loads((found["export"] / "config.json").read_text()).get("quantization_config")

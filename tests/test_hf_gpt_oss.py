"""GPT-OSS weights in and out, through `transformers` itself: a random GptOssForCausalLM (attention
biases and sinks, sliding-window and full layers alternating, YaRN without truncation, experts with
biases and the clamped SwiGLU) saved by transformers is read by `model=hf` and loaded into our
model with transformers' logits; the same experts stored as the published checkpoints store them
(MXFP4 blocks and scales) load equal to transformers' own dequantization; our export opens in
transformers with our logits; a folder whose config.json says what is not built here is refused.
On ranks (slow): fsdp·ep2 and tp2 load the folder to transformers' first loss and export it in
bfloat16; the layouts' loss parity: tests/test_moe.py."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import FP4_VALUES, _convert_moe_packed_tensors

from titan_exp.checkpoint.hf import load_hf, save_hf
from titan_exp.checkpoint.hf_export import ExportSources
from titan_exp.checkpoint.safetensors_folder import SafetensorsFolder
from titan_exp.data.config import DataConfig
from titan_exp.data.loader import BatchLoader, BatchPlan, build_source
from titan_exp.models.hf_tensors import check_hf_checkpoint
from titan_exp.models.registry import FAMILIES, build_model, config_from_hf
from titan_exp.rules import ConfigError

from conftest import assert_bfloat16_export_gives_our_logits, loss_curve, mlflow_runs, run_cli, store_in
from hf_checkpoints import GPT_OSS_SHAPE, mxfp4

VOCAB, SEQ, WINDOW = (GPT_OSS_SHAPE[key] for key in ("vocab_size", "max_position_embeddings", "sliding_window"))


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def our_model(folder: Path) -> torch.nn.Module:
    cfg = config_from_hf(str(folder), "model.hf_path")
    model = build_model(cfg)
    model.init_weights(seed=1)  # overwritten by the load
    load_hf(model, str(folder), cfg)
    return model


def our_logits(folder: Path) -> torch.Tensor:
    with torch.no_grad():
        return our_model(folder)(tokens())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**GPT_OSS_SHAPE)).float()
    with torch.no_grad():  # transformers starts biases at zero: random ones, so that a misread one shows
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5)
            elif "experts" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(tmp / "bf16-layout")
    with torch.no_grad():
        logits = model(tokens()).logits
    return {"folder": tmp / "bf16-layout", "logits": logits, "tmp": tmp}


def test_our_model_loaded_from_the_folder_gives_transformers_logits(saved):
    cfg = config_from_hf(str(saved["folder"]), "model.hf_path")
    assert cfg.name == "gpt_oss" and (cfg.sliding_window, cfg.head_dim, cfg.kv_heads) == (WINDOW, 16, 2)
    assert cfg.rope_scaling_type == "yarn" and cfg.rope_scaling_factor == 32.0 and not cfg.rope_yarn_truncate
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.hidden_dim, moe.bias, moe.swiglu_limit) == (4, 2, 64, True, 1.5)
    torch.testing.assert_close(our_logits(saved["folder"]), saved["logits"], rtol=1e-5, atol=1e-5)


def test_mxfp4_experts_load_as_transformers_dequantizes_them(saved):
    """The experts' matrices as MXFP4 (gpt-oss's published `…_blocks`/`…_scales`, experts × out ×
    in); beside them a folder with transformers' own dequantization of the same bytes
    (integrations/mxfp4.py) in the bfloat16 layout. Both load to the same model, and any box of
    a tensor (a rank's shard) reads as that part of the dequantized whole."""
    source, generator = saved["folder"], torch.Generator().manual_seed(2)
    packed, dequantized = saved["tmp"] / "mxfp4", saved["tmp"] / "dequantized"
    stored, plain = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4((tensor.shape[0], tensor.shape[2], tensor.shape[1]), generator)
            stored[f"{name}_blocks"], stored[f"{name}_scales"] = blocks, scales
            plain[name] = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # experts × in × out
        else:
            stored[name] = plain[name] = tensor
    for folder, tensors in ((packed, stored), (dequantized, plain)):
        folder.mkdir()
        config = json.loads((source / "config.json").read_text())
        if folder is packed:
            config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
        (folder / "config.json").write_text(json.dumps(config))
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    # Every e2m1 code occurs (the low and the high nibble alike), so each maps through the table.
    down = stored["model.layers.0.mlp.experts.down_proj_blocks"]
    assert set((down & 0x0F).unique().tolist()) == set((down >> 4).unique().tolist()) == set(range(len(FP4_VALUES)))
    torch.testing.assert_close(our_logits(packed), our_logits(dequantized), rtol=0, atol=0)
    reader = SafetensorsFolder(str(packed))
    for name in (n for n in plain if n.endswith("_proj") and "experts" in n):
        whole = plain[name].transpose(1, 2)  # back to experts × out × in
        assert reader.has_mxfp4(name)
        for _ in range(3):  # boxes that start and end inside blocks
            starts = [int(torch.randint(0, n, (), generator=generator)) for n in whole.shape]
            box = tuple(
                slice(a, int(torch.randint(a + 1, n + 1, (), generator=generator))) for a, n in zip(starts, whole.shape)
            )
            torch.testing.assert_close(reader.read_mxfp4(name, box), whole[box], rtol=0, atol=0, msg=name)
    # The bytes are not the weights they replaced: the model is another.
    assert not torch.allclose(our_logits(packed), saved["logits"], atol=1e-3)


def test_our_export_opens_in_transformers_with_our_logits(saved, tmp_path):
    cfg = config_from_hf(str(saved["folder"]), "model.hf_path")
    model = our_model(saved["folder"])
    save_hf([model], tmp_path / "export", cfg, True, torch.float32, ExportSources(None, None))
    names = set(json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())["weight_map"])
    assert {"model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.self_attn.sinks"} <= names
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens()).logits, model(tokens()), rtol=1e-5, atol=1e-5)


def test_our_config_json_is_one_transformers_builds_the_same_model_from(saved):
    cfg = config_from_hf(str(saved["folder"]), "model.hf_path")
    hf = FAMILIES["gpt_oss"].hf
    config = transformers.GptOssConfig.from_dict(hf.hf_config(cfg, "float32"))
    with torch.device("meta"):
        theirs = transformers.GptOssForCausalLM(config)
    assert {name: tuple(p.shape) for name, p in theirs.state_dict().items()} == hf.expected_shapes(cfg, fused=True)


@pytest.mark.parametrize(
    "change,named",
    [
        ({"attention_bias": False}, "attention_bias=false; GPT-OSS's attention projections have biases"),
        ({"layer_types": ["full_attention"] * 4}, "layer_types other than sliding and full attention alternating"),
        ({"swiglu_alpha": 1.0}, "swiglu_alpha=1.0; the experts' gate gain here is GPT-OSS's 1.702"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                              "rope_theta": 150000.0, "attention_factor": 2.0}},
         "rope_parameters.attention_factor; here YaRN's magnitude is 0.1·ln(factor) + 1"),
    ],
)  # fmt: skip
def test_a_config_json_describing_another_model_is_refused_naming_the_key(saved, tmp_path, change, named):
    config = {**json.loads((saved["folder"] / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="^model.hf_path=") as refused:
        config_from_hf(str(tmp_path), "model.hf_path")
    assert named in str(refused.value)


# On ranks: the box each reads (its experts, its heads' rows of q/k with their biases, its sinks).
LAYOUTS = {
    "fsdp2·ep2": ["parallelism=fsdp", "training.local_batch_size=2", "parallelism.expert_parallel_degree=2"],
    "tp2": ["parallelism=tp", "training.local_batch_size=4"],  # TP splits each expert
}


@pytest.mark.slow  # 2 CLI runs of 2 ranks; the default suite loads and exports in-process (above)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ranks_load_their_boxes_to_transformers_first_loss_and_export_in_bfloat16(
    saved, layout, tmp_path, migrated_store
):
    uri, db = store_in(tmp_path, migrated_store)
    folder = saved["folder"]
    run = [
        "data=synthetic", f"data.synthetic_vocab_size={VOCAB}", f"training.seq_len={SEQ}",
        "training.global_batch_size=4", "training.steps=2", "metrics.log_freq=1", "launcher.device=cpu",
        "launcher.nproc_per_node=2", *LAYOUTS[layout], "model=hf", f"model.hf_path={folder}",
        f"checkpoint.initial_load_path={folder}", "checkpoint.initial_load_in_hf=true", "checkpoint=periodic",
        f"checkpoint.folder={tmp_path}/ckpt", "checkpoint.last_save_in_hf=true", "checkpoint.export_dtype=bfloat16",
        uri,
    ]  # fmt: skip
    done = run_cli(run, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (tracked,) = mlflow_runs(db)
    source = build_source(DataConfig(source="synthetic", synthetic_vocab_size=VOCAB), SEQ, seed=0)
    inputs, labels = BatchLoader(source, BatchPlan(4, SEQ, 1, 0, 1)).get(0, 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs).logits.reshape(-1, VOCAB), labels.reshape(-1)).item()
    assert loss_curve(db, tracked.info.run_id)[0] == pytest.approx(expected, rel=1e-5)

    step = tmp_path / "ckpt" / "step-2"
    assert json.loads((step / "config.json").read_text())["dtype"] == "bfloat16"
    assert_bfloat16_export_gives_our_logits(step, inputs)


def test_a_checkpoint_of_another_shape_is_refused_before_any_rank_starts(saved, tmp_path):
    folder = saved["folder"]
    done = run_cli(
        ["model=gpt_oss_debug", "tracking=none", f"checkpoint.initial_load_path={folder}",
         "checkpoint.initial_load_in_hf=true"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 2 and not (tmp_path / "outputs").exists(), done.stderr[-3000:]
    assert done.stderr.strip() == (
        f"titan_exp: config error: model.dim=256: the checkpoint in {folder} has 64; "
        f"add model=hf model.hf_path={folder} to take the model's shape from it"
    )


def test_mxfp4_blocks_of_another_shape_are_refused_naming_the_tensor(saved, tmp_path):
    cfg = config_from_hf(str(saved["folder"]), "model.hf_path")
    tensors = load_file(saved["folder"] / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    experts, hidden, dim = tensors.pop(name).shape
    tensors[f"{name}_blocks"] = torch.zeros(experts, dim, hidden // 32, 8, dtype=torch.uint8)  # half the bytes
    tensors[f"{name}_scales"] = torch.zeros(experts, dim, hidden // 32, dtype=torch.uint8)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError) as refused:
        check_hf_checkpoint(cfg, cfg, FAMILIES["gpt_oss"].hf, str(tmp_path), "checkpoint.initial_load_path")
    assert str(refused.value) == (
        f"checkpoint.initial_load_path={tmp_path}: holds {name}_blocks as U8 [4, 64, 2, 8]; "
        "MXFP4 of the model's is U8 [4, 64, 2, 16]"
    )


def test_what_a_config_json_leaves_out_is_what_transformers_takes(saved, tmp_path):
    """No rotary table: transformers' GptOssConfig's own YaRN (factor 32, untruncated); no kv-head
    count: its 8 (which this folder's 4 heads cannot take: refused naming it)."""
    config = json.loads((saved["folder"] / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = config_from_hf(str(tmp_path), "model.hf_path")
    rope = transformers.GptOssConfig.from_dict(config).rope_parameters
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_yarn_truncate) == ("yarn", rope["factor"], False)
    assert cfg.rope_original_max_seq_len == rope["original_max_position_embeddings"]
    assert cfg.rope_theta == rope["rope_theta"]
    del config["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="its config.json makes model.n_kv_heads=8: must divide n_heads=4"):
        config_from_hf(str(tmp_path), "model.hf_path")

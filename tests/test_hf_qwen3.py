"""Qwen3 and Qwen3-MoE weights in and out, through `transformers` itself: random Qwen3ForCausalLM and
Qwen3MoeForCausalLM models saved by transformers (the MoE one with one tensor per expert, as the
published checkpoints and save_pretrained's default hold them, and in transformers' fused layout)
are read by `model=hf`, loaded into our model (their logits equal transformers'), trained under
FSDP with expert parallelism (each rank reading only its experts: the first loss equals
transformers' on the same batch) and written back in the published layout, which transformers
opens with our logits. (Llama: tests/test_hf_weights.py; the formats' shapes on the meta device:
tests/unit/test_unit_hf_format.py.)"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from titan_exp.checkpoint.hf import load_hf
from titan_exp.models.registry import build_model, config_from_hf

from conftest import assert_bfloat16_export_gives_our_logits, loss_curve, mlflow_runs, run_cli, store_in
from hf_checkpoints import QWEN3_MOE, QWEN3_SHAPE

SEQ = 32
VOCAB = QWEN3_SHAPE["vocab_size"]


def save_random(folder: Path, moe: bool, fused: bool = False) -> Path:
    torch.manual_seed(0)
    if moe:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_SHAPE, **QWEN3_MOE))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3_SHAPE))
    with torch.no_grad():  # q/k norms of ones would hide a wrong channel order
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder, save_original_format=not fused)
    return folder


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))


def transformers_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens()[:, :-1]).logits


def our_logits(folder: Path) -> torch.Tensor:
    cfg = config_from_hf(str(folder), "model.hf_path")
    model = build_model(cfg)
    model.init_weights(seed=1)  # overwritten by the load
    load_hf(model, str(folder), cfg)
    with torch.no_grad():
        return model(tokens()[:, :-1])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("qwen3")
    return {
        "dense": save_random(tmp / "dense", moe=False),
        "moe": save_random(tmp / "moe", moe=True),
        "moe fused": save_random(tmp / "moe-fused", moe=True, fused=True),
    }


def test_the_published_expert_layout_is_what_save_pretrained_writes_and_fused_is_the_other(folders):
    def names(folder: Path) -> set[str]:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            return set(json.loads(index.read_text())["weight_map"])
        from safetensors import safe_open

        with safe_open(folder / "model.safetensors", "pt") as file:
            return set(file.keys())

    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names(folders["moe"])
    assert "model.layers.1.mlp.experts.gate_up_proj" in names(folders["moe fused"])


@pytest.mark.parametrize("kind", ["dense", "moe", "moe fused"])
def test_our_model_loaded_from_the_folder_gives_transformers_logits(folders, kind):
    cfg = config_from_hf(str(folders[kind]), "model.hf_path")
    assert cfg.name == "qwen3" and cfg.head_dim == 32 and cfg.moe.enabled == (kind != "dense")
    if cfg.moe.enabled:
        assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.hidden_dim, cfg.moe.n_dense_layers) == (4, 2, 48, 1)
    torch.testing.assert_close(our_logits(folders[kind]), transformers_logits(folders[kind]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # 2 ranks, 2 steps and an export; the default suite loads in-process (above)
def test_fsdp_with_expert_parallelism_loads_its_own_experts_trains_and_exports_the_published_layout(
    folders, tmp_path, migrated_store
):
    """2 ranks, FSDP·EP2, on documents through a tokenizer of the run's own: each rank reads the two
    experts it holds; the first loss is transformers' on the same batch; the export (in bfloat16)
    holds one tensor per expert and the run's tokenizer files, and transformers opens it with the
    logits of our checkpoint of the same step."""
    from titan_exp.data.config import DataConfig
    from titan_exp.data.loader import BatchLoader, BatchPlan, build_source
    from titan_exp.data.text import train_tokenizer

    folder = folders["moe"]
    docs = [f"document {i} says " + " ".join(["words", "of", "the", "run"][: 1 + i % 4] * 5) for i in range(60)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(train_tokenizer(docs, 300).to_str())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    data = DataConfig(
        source="files", paths=[str(tmp_path / "docs.jsonl")], tokenizer_path=str(tmp_path / "tok" / "tokenizer.json")
    )
    uri, db = store_in(tmp_path, migrated_store)
    run = [
        "data=files",
        f"data.paths=[{data.paths[0]}]",
        f"data.tokenizer_path={data.tokenizer_path}",
        f"training.seq_len={SEQ}",
        "training.global_batch_size=4",
        "training.local_batch_size=2",
        "training.steps=2",
        "metrics.log_freq=1",
        "launcher.device=cpu",
        "parallelism=fsdp",
        "parallelism.expert_parallel_degree=2",
        "launcher.nproc_per_node=2",
        "model=hf",
        f"model.hf_path={folder}",
        f"checkpoint.initial_load_path={folder}",
        "checkpoint.initial_load_in_hf=true",
        "checkpoint=periodic",
        f"checkpoint.folder={tmp_path}/ckpt",
        "checkpoint.last_save_in_hf=true",
        "checkpoint.export_dtype=bfloat16",
        uri,
    ]
    done = run_cli(run, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (tracked,) = mlflow_runs(db)
    first_loss = loss_curve(db, tracked.info.run_id)[0]

    inputs, labels = BatchLoader(build_source(data, SEQ, seed=0), BatchPlan(4, SEQ, 1, 0, 1)).get(0, 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs).logits.reshape(-1, VOCAB), labels.reshape(-1)).item()
    assert first_loss == pytest.approx(expected, rel=1e-5)

    step = tmp_path / "ckpt" / "step-2"
    weight_map = json.loads((step / "model.safetensors.index.json").read_text())["weight_map"]
    assert {f"model.layers.1.mlp.experts.{j}.down_proj.weight" for j in range(4)} <= set(weight_map)
    config, original = (json.loads((folder_ / "config.json").read_text()) for folder_ in (step, folder))
    assert config["model_type"] == "qwen3_moe" and config["dtype"] == "bfloat16"
    # The original's config.json kept, but for the weights' dtype the run changed (under both names)
    # and the special tokens of the run's tokenizer (the folder has none of its own).
    changed = {key for key in {*config, *original} if config.get(key) != original.get(key)}
    assert changed <= {"dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id"}
    assert config["eos_token_id"] == transformers.AutoTokenizer.from_pretrained(step).eos_token_id is not None
    assert transformers.AutoTokenizer.from_pretrained(step).encode("words of the run") == [
        *transformers.AutoTokenizer.from_pretrained(tmp_path / "tok").encode("words of the run")
    ]
    assert_bfloat16_export_gives_our_logits(step, inputs)

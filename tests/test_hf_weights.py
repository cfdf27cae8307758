"""Hugging Face weights in and out, through `transformers` itself: a random LlamaForCausalLM saved by
transformers (sharded safetensors with an index, or one file with tied embeddings) is loaded by
titan_exp into four layouts, trained two steps and written back with checkpoint.last_save_in_hf;
transformers opens what was written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from titan_exp.checkpoint.manager import load_model
from titan_exp.data.config import DataConfig
from titan_exp.data.loader import BatchLoader, BatchPlan, build_source
from titan_exp.models.config import ModelConfig
from titan_exp.models.hf import refusing
from titan_exp.models.registry import FAMILIES, build_model

from conftest import loss_curve, mlflow_runs, run_cli, store_in

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 256, 32, 4, 2
SHAPE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    # Wider than transformers' 0.02: logits far from uniform, so a wrongly ordered weight shows in the loss.
    initializer_range=0.1,
)
RUN = [
    "data=synthetic",
    f"data.synthetic_vocab_size={VOCAB}",
    f"training.seq_len={SEQ}",
    f"training.global_batch_size={GLOBAL_BATCH}",
    f"training.steps={STEPS}",
    "metrics.log_freq=1",
    "launcher.device=cpu",
]
# Every layout takes the same 4 sequences a step (accumulating where it has fewer data-parallel ranks).
LAYOUTS = {
    "single": ["parallelism=single", "training.local_batch_size=2"],
    "fsdp2": ["parallelism=fsdp", "launcher.nproc_per_node=2", "training.local_batch_size=2"],
    "tp2": ["parallelism=tp", "launcher.nproc_per_node=2", "training.local_batch_size=2"],
    "pp2": [
        "parallelism=pp",
        "launcher.nproc_per_node=2",
        "training.local_batch_size=4",
        "parallelism.pipeline_parallel_microbatch_size=1",
    ],
}


def save_random_llama(folder: Path, **changes) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SHAPE, **changes})
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="100KB")  # several files and an index
    return folder


def hf_load(folder: Path) -> list[str]:
    return [
        "model=hf",
        f"model.hf_path={folder}",
        f"checkpoint.initial_load_path={folder}",
        "checkpoint.initial_load_in_hf=true",
    ]


def export_to(folder: Path) -> list[str]:
    return ["checkpoint=periodic", f"checkpoint.folder={folder}", "checkpoint.last_save_in_hf=true"]


def first_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1's global batch, as every layout's ranks take it between them."""
    source = build_source(DataConfig(source="synthetic", synthetic_vocab_size=VOCAB), SEQ, seed=0)
    return BatchLoader(source, BatchPlan(GLOBAL_BATCH, SEQ, 1, 0, 1)).get(0, 0)


def transformers_loss(folder: Path) -> float:
    inputs, labels = first_batch()
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(inputs).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).item()


def logits_of_export(step_folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformers' logits from the exported safetensors, ours from the same step's DCP checkpoint)."""
    inputs, _ = first_batch()
    hf_model = transformers.LlamaForCausalLM.from_pretrained(step_folder, dtype=torch.float32)
    cfg = ModelConfig(
        **FAMILIES["llama3"].hf.fields_from_hf(
            json.loads((step_folder / "config.json").read_text()), refusing("test", "")
        )
    )
    ours = build_model(cfg)
    ours.init_weights(seed=1)  # overwritten by the load below
    load_model(ours, str(step_folder))
    with torch.no_grad():
        return hf_model(inputs).logits, ours(inputs)


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="module")
def exports(untied, tmp_path_factory, migrated_store) -> dict[str, tuple[float, Path]]:
    """Each layout's first loss (from MLflow) and its last step's folder."""

    tmp = tmp_path_factory.mktemp("layouts")
    uri, db = store_in(tmp, migrated_store)
    found = {}
    for name, layout in LAYOUTS.items():
        folder = tmp / name / "ckpt"
        done = run_cli([*RUN, *layout, *hf_load(untied), *export_to(folder), uri], tmp / name)
        assert done.returncode == 0, done.stderr[-3000:]
        run = mlflow_runs(db)[-1]
        found[name] = (loss_curve(db, run.info.run_id)[0], folder / f"step-{STEPS}")
    return found


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_loaded_model_scores_the_first_batch_as_transformers_does(layout, exports, untied):
    first_loss, _ = exports[layout]
    assert first_loss == pytest.approx(transformers_loss(untied), rel=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transformers_opens_the_export_with_our_logits(layout, exports, untied):
    _, step_folder = exports[layout]
    assert (step_folder / "model.safetensors.index.json").is_file() and not (step_folder / "sharded").exists()
    theirs, ours = logits_of_export(step_folder)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    # Trained: the export is not the checkpoint it started from.
    assert transformers_loss(step_folder) != pytest.approx(transformers_loss(untied), rel=1e-6)


def test_the_export_keeps_the_original_config_and_generation_config(exports, untied):
    """Nothing of the model changed but its weights (float32, as saved): config.json as it was."""
    step_folder = exports["fsdp2"][1]
    for name in ("config.json", "generation_config.json"):
        assert json.loads((step_folder / name).read_text()) == json.loads((untied / name).read_text()), name


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_titan_exp_export_writes_the_runs_own_export_from_any_layouts_checkpoint(layout, exports, tmp_path):
    """The DCP checkpoint of a sharded layout, exported afterwards, is what the run exported at its end."""
    step_folder = exports[layout][1]
    out = tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "titan_exp", "export", str(step_folder), "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"titan_exp export: {out} (float32) from {step_folder}"
    written = {path.name for path in out.iterdir()}
    assert written == {path.name for path in step_folder.iterdir() if not path.name.startswith((".", "__"))} - {
        "model.json"
    }
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        assert json.loads((out / name).read_text()) == json.loads((step_folder / name).read_text()), name
    for shard in out.glob("*.safetensors"):
        ours, theirs = load_file(shard), load_file(step_folder / shard.name)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), shard.name


def test_every_layout_exports_the_same_trained_weights(exports):
    reference, _ = logits_of_export(exports["single"][1])
    for layout in LAYOUTS:
        theirs, _ = logits_of_export(exports[layout][1])
        torch.testing.assert_close(theirs, reference, rtol=1e-3, atol=1e-4, msg=layout)


def test_a_tied_model_loads_and_exports_its_one_matrix(tmp_path, store):
    uri, db = store
    tied = save_random_llama(tmp_path / "tied-llama", tie_word_embeddings=True)
    layout = LAYOUTS["fsdp2"]
    done = run_cli([*RUN, *layout, *hf_load(tied), *export_to(tmp_path / "ckpt"), uri], tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = mlflow_runs(db)
    assert loss_curve(db, run.info.run_id)[0] == pytest.approx(transformers_loss(tied), rel=1e-5)
    step_folder = tmp_path / "ckpt" / f"step-{STEPS}"
    weight_map = json.loads((step_folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map and "model.embed_tokens.weight" in weight_map
    assert json.loads((step_folder / "config.json").read_text())["tie_word_embeddings"] is True
    theirs, ours = logits_of_export(step_folder)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)


def refusal(args: list[str], tmp_path: Path) -> str:
    done = run_cli([*RUN, "parallelism=single", "tracking=none", *args], tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    return line


def test_a_checkpoint_of_another_shape_is_refused_naming_the_field(untied, tmp_path):
    line = refusal([f"checkpoint.initial_load_path={untied}", "checkpoint.initial_load_in_hf=true"], tmp_path)
    assert line == (
        f"titan_exp: config error: model.dim=256: the checkpoint in {untied} has 64; "
        f"add model=hf model.hf_path={untied} to take the model's shape from it"
    )


def test_weights_that_contradict_their_config_are_refused(untied, tmp_path):
    lying = tmp_path / "lying"
    lying.mkdir()
    for file in untied.iterdir():
        (lying / file.name).symlink_to(file)
    config = json.loads((untied / "config.json").read_text())
    (lying / "config.json").unlink()
    (lying / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    line = refusal([*hf_load(lying)], tmp_path)
    assert line.startswith(f"titan_exp: config error: checkpoint.initial_load_path={lying}: holds ")
    assert "mlp.gate_proj.weight of shape [160, 64], the model's is [128, 64]" in line


@pytest.mark.parametrize(
    "args,expected",
    [
        (["model=hf"], "model.hf_path=None: model=hf takes its shape from a Hugging Face model folder; set it"),
        (
            ["checkpoint.initial_load_in_hf=true"],
            "checkpoint.initial_load_in_hf=True: says how to read checkpoint.initial_load_path, which is not set",
        ),
        (
            ["checkpoint.last_save_in_hf=true"],
            "checkpoint.last_save_in_hf=True: needs checkpoint.enable=true (add checkpoint=periodic) to save at all",
        ),
    ],
)
def test_incomplete_hf_options_are_refused(args, expected, tmp_path):
    assert refusal(args, tmp_path) == f"titan_exp: config error: {expected}"


def test_another_architecture_is_refused(untied, tmp_path):
    other = tmp_path / "mistral"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**SHAPE, "model_type": "mistral"}))
    line = refusal(["model=hf", f"model.hf_path={other}"], tmp_path)
    assert line == (
        f"titan_exp: config error: model.hf_path={other}: its config.json has model_type=mistral; "
        "the config.json model types read here: llama (llama3), qwen3 (qwen3), qwen3_moe (qwen3), "
        "deepseek_v3 (deepseek_v3), gpt_oss (gpt_oss)"
    )

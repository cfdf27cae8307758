"""An export in Hugging Face's format is the model others use: it keeps the config.json of the folder
the model came from but for what the run changed, its generation config (so `generate()` stops
where the original stops) and its tokenizer's files and chat template; a model built from a
flavor gets a complete config, its token ids from the run's tokenizer. `titan_exp export` writes
the same from a checkpoint already written, and refuses a wrong command before torch loads.
(Every layout's export through the CLI: tests/test_hf_weights.py.)"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from titan_exp.checkpoint.hf import load_hf, save_hf
from titan_exp.checkpoint.hf_export import ExportSources, write_beside_weights
from titan_exp.config.compose import compose_job_config
from titan_exp.config.resolve import resolve
from titan_exp.data.text import train_tokenizer
from titan_exp.models.registry import build_model, config_from_hf, family_of

from conftest import REPO
from hf_checkpoints import QWEN3_MOE, QWEN3_SHAPE

VOCAB = QWEN3_SHAPE["vocab_size"]
PROMPT = torch.tensor([[5, 17, 42, 7]])
# What each tokenizer file holds beside the tokenizer.json the tests train.
TOKENIZER_CONFIG = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"}
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def tokenizer_folder(folder: Path, vocab: int) -> Path:
    """A tokenizer.json of `vocab` ids with its specials, tokenizer_config.json and chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = [f"document {i} says " + " ".join(["words", "of", "the", "run"][: 1 + i % 4] * 5) for i in range(60)]
    tokenizer = train_tokenizer(docs, vocab - 1)
    tokenizer.add_special_tokens(["<|pad|>"])
    (folder / "tokenizer.json").write_text(tokenizer.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


def greedy(model: transformers.PreTrainedModel, **generation) -> list[int]:
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=12, do_sample=False, **generation)
    return out[0, PROMPT.shape[1] :].tolist()


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """A Qwen3-MoE folder as a user has it: config.json with its special tokens and an auxiliary
    loss coefficient transformers does not apply (no router logits), generation_config.json, the
    tokenizer's files. Its end-of-sequence token is a token its greedy decoding of
    PROMPT would give at the third place or later (the first not given before), so that generate() stops there."""
    folder = tmp_path_factory.mktemp("original") / "tiny-qwen3-moe"
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**QWEN3_SHAPE, **QWEN3_MOE, router_aux_loss_coef=0.001, pad_token_id=0)
    model = transformers.Qwen3MoeForCausalLM(config)
    tokens = greedy(model, eos_token_id=None, pad_token_id=0)
    eos = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    model.config.bos_token_id, model.config.eos_token_id = 1, eos
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=eos, pad_token_id=0)
    model.save_pretrained(folder)
    tokenizer_folder(folder, VOCAB)
    return folder


def exported(original: Path, out: Path, dtype: torch.dtype, **keys_set) -> Path:
    """The original's model loaded and exported in this process, with `keys_set` beside model=hf."""
    cfg = config_from_hf(str(original), "model.hf_path", keys_set)
    model = build_model(cfg)
    load_hf(model, str(original), cfg)
    save_hf([model], out, cfg, True, dtype, ExportSources(str(original), None))
    return out


def test_an_export_keeps_the_original_config_but_for_what_the_run_changed(original, tmp_path):
    out = exported(original, tmp_path / "export", torch.bfloat16, **{"moe.aux_loss_coeff": 0.01})
    theirs, ours = (json.loads((folder / "config.json").read_text()) for folder in (original, out))
    changed = {key for key in {*theirs, *ours} if theirs.get(key) != ours.get(key)}
    # The weights' dtype (under both names transformers reads) and the auxiliary loss now set.
    assert changed <= {"dtype", "torch_dtype", "output_router_logits", "router_aux_loss_coef"}
    assert (ours["dtype"], ours["output_router_logits"], ours["router_aux_loss_coef"]) == ("bfloat16", True, 0.01)
    generation = (json.loads((folder / "generation_config.json").read_text()) for folder in (original, out))
    assert next(generation) == next(generation)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (original / name).read_bytes(), name


def test_a_table_the_run_changed_is_written_whole_and_what_it_dropped_goes(tmp_path):
    """A transformers 4 config.json (rope_scaling beside rope_theta, no rope_parameters) of a model
    whose rotary scaling the run turned off: no half table, no scaling factor left behind."""
    model = resolve(compose_job_config(["model=llama3_1b", "launcher.nproc_per_node=1"]), place=False).config.model
    written = family_of(model).hf.hf_config(model, "bfloat16")
    del written["rope_parameters"]
    (tmp_path / "t4").mkdir()
    (tmp_path / "t4" / "config.json").write_text(json.dumps(written))
    cfg = config_from_hf(str(tmp_path / "t4"), "model.hf_path", {"rope_scaling_factor": None})
    (tmp_path / "out").mkdir()
    assert write_beside_weights(tmp_path / "out", cfg, "bfloat16", ExportSources(str(tmp_path / "t4"), None)) == []
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_scaling"] is None
    assert config["rope_parameters"] == {"rope_theta": model.rope_theta, "rope_type": "default"}
    assert {key for key in {*config, *written} if config.get(key) != written.get(key)} == {
        "rope_scaling",
        "rope_parameters",
    }
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").rope_parameters["rope_type"] == "default"


def test_a_model_trained_on_another_tokenizer_takes_its_ids(original, tmp_path):
    """The folder's tokenizer replaced by the run's, whose end of document is another token: the
    config and generation config name the run's tokenizer's ids, said in a note."""
    other = tokenizer_folder(tmp_path / "other", VOCAB)
    (other / "tokenizer_config.json").write_text(json.dumps({**TOKENIZER_CONFIG, "eos_token": "<|pad|>"}))
    cfg = config_from_hf(str(original), "model.hf_path")
    out = tmp_path / "out"
    out.mkdir()
    notes = write_beside_weights(out, cfg, "float32", ExportSources(str(original), str(other / "tokenizer.json")))
    assert notes == [f"trained on {other / 'tokenizer.json'}, not the tokenizer of {original}: its token ids"]
    pad = transformers.AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("<|pad|>")
    for name in ("config.json", "generation_config.json"):
        written = json.loads((out / name).read_text())
        assert written["eos_token_id"] == written["pad_token_id"] == pad, name


def test_an_export_with_nothing_changed_keeps_the_original_config_whole(original, tmp_path):
    out = exported(original, tmp_path / "export", torch.float32)
    assert json.loads((out / "config.json").read_text()) == json.loads((original / "config.json").read_text())


def test_generate_on_the_export_stops_where_the_original_stops(original, tmp_path):
    out = exported(original, tmp_path / "export", torch.float32)
    theirs = greedy(transformers.AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32))
    ours = greedy(transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32))
    eos = json.loads((original / "config.json").read_text())["eos_token_id"]
    assert ours == theirs and ours[-1] == eos and len(ours) < 12  # stopped at its end-of-sequence token


def test_a_flavors_export_takes_its_token_ids_from_the_runs_tokenizer(tmp_path):
    cfg = resolve(compose_job_config(["model=qwen3_debug", "launcher.nproc_per_node=1"]), place=False).config.model
    tokenizer = tokenizer_folder(tmp_path / "tok", 300) / "tokenizer.json"
    model = build_model(cfg)
    model.init_weights(seed=0)
    out = tmp_path / "export"
    save_hf([model], out, cfg, True, torch.float32, ExportSources(None, str(tokenizer)))
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    ids = {name: loaded.convert_tokens_to_ids(token) for name, token in TOKENIZER_CONFIG.items()}
    config, generation = (json.loads((out / name).read_text()) for name in ("config.json", "generation_config.json"))
    for name, token_id in ids.items():
        assert config[f"{name}_id"] == generation[f"{name}_id"] == token_id, name
    assert transformers.AutoModelForCausalLM.from_pretrained(out).generation_config.eos_token_id == ids["eos_token"]
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_a_trained_tokenizer_is_exported_with_what_opens_it(tmp_path):
    """data=text's BPE, a bare tokenizer.json: its tokenizer_config.json names its end of document."""
    cfg = resolve(compose_job_config(["model=qwen3_debug", "launcher.nproc_per_node=1"]), place=False).config.model
    (tmp_path / "cache").mkdir()
    bare = tmp_path / "cache" / "tokenizer.json"
    bare.write_text(train_tokenizer(["a few words of text"] * 20, 300).to_str())
    model = build_model(cfg)
    model.init_weights(seed=0)
    save_hf([model], tmp_path / "export", cfg, True, torch.float32, ExportSources(None, str(bare)))
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert loaded.eos_token == "<|end_of_text|>"
    assert json.loads((tmp_path / "export" / "config.json").read_text())["eos_token_id"] == loaded.eos_token_id


def export_cli(*args: str) -> subprocess.CompletedProcess:
    """`titan_exp export ARGS`, in a process that says whether it loaded torch."""
    code = (
        "import sys; from titan_exp.job import export; status = export.main(sys.argv[1:]); "
        "print('torch loaded' if 'torch' in sys.modules else 'no torch', file=sys.stderr); sys.exit(status)"
    )
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "make,expected",
    [
        (lambda d: d, "STEP_FOLDER={step}: is not a checkpoint (no .metadata); point it at <checkpoint.folder>/step-N"),
        (
            lambda d: (d / ".metadata").touch(),
            "STEP_FOLDER={step}: has no model.json, which says which model it holds",
        ),
        (
            lambda d: [(d / ".metadata").touch(), (d / "model.json").write_text('{"model": {"name": "foo"}}')],
            "STEP_FOLDER={step}: holds a foo model; "
            "Hugging Face's format is written of llama3, qwen3, deepseek_v3, gpt_oss models",
        ),
        (
            lambda d: [(d / ".metadata").touch(), (d / "model.json").write_text("[1, 2")],
            "STEP_FOLDER={step}: its model.json cannot be read (Expecting ',' delimiter: line 1 column 6 (char 5)); "
            "point STEP_FOLDER elsewhere",
        ),
    ],
    ids=["no checkpoint", "no record", "unknown model", "a broken record"],
)
def test_a_wrong_export_is_refused_in_one_line_before_torch_loads(make, expected, tmp_path):
    step = tmp_path / "step-3"
    step.mkdir()
    make(step)
    done = export_cli(str(step), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"titan_exp export: {expected.format(step=step)}", "no torch"]
    assert not (tmp_path / "out").exists()


def test_an_export_into_a_folder_that_exists_is_refused(tmp_path):
    step = tmp_path / "step-3"
    step.mkdir()
    (step / ".metadata").touch()
    model = resolve(compose_job_config(["launcher.nproc_per_node=1"]), place=False).config.model
    (step / "model.json").write_text(json.dumps({"model": dataclasses.asdict(model)}))
    (tmp_path / "out").mkdir()
    done = export_cli(str(step), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    line = f"titan_exp export: --out={tmp_path / 'out'}: exists; name a new folder (nothing is written over)"
    assert done.stderr.splitlines() == [line, "no torch"]

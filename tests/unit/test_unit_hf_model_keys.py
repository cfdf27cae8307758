"""`model=hf` takes the model from a Hugging Face folder and every `model.*` key set beside it on
top: for each family's folder, every key of its section set to another value is either applied
(the resolved config, so `show` and the run's params, holds it) or refused: where it would change
a weight's shape (naming the key and the folder's value; which keys do is asked of the model
itself, the family's module built on the meta device) or make a model the folder's format cannot
hold (another architecture than the folder's)."""

import copy
import dataclasses
import json
import re
from operator import attrgetter
from pathlib import Path

import pytest
import torch

from titan_exp.config.compose import compose_job_config
from titan_exp.config.resolve import resolve
from titan_exp.config.schema import JobConfig
from titan_exp.models.config import ModelConfig
from titan_exp.models.registry import FAMILIES, build_model, family_of
from titan_exp.rules import ConfigError

from conftest import REPO

# The option of each family whose config.json the folder holds (written by the family's own format).
FOLDERS = ("llama3_debug", "qwen3_debug", "qwen3_moe_debug", "deepseek_v3_debug", "gpt_oss_debug")
DOCS = REPO / "docs" / "running.md"
# Composed for planning on one rank (config/resolve.py, place=False).
ONE_RANK = ("launcher.nproc_per_node=1",)
# Keys that are never applied over the folder: the labels (refused on the command line) and the folder.
NOT_SET = ("name", "flavor", "hf_path")
# Values tried for each key, the first that differs from the folder's (and passes the key's rules).
CANDIDATES: dict[str, tuple] = {
    "dim": (128, 96),
    "n_layers": (3, 4),
    "n_heads": (8, 2),
    "n_kv_heads": (1, 2),
    "attention_head_dim": (64, 16),
    "vocab_size": (4096, 1024),
    "multiple_of": (128, 64),
    "ffn_dim_multiplier": (1.5, 1.3),
    "intermediate_size": (96, 192),
    "norm_eps": (1e-3, 1e-4),
    "rope_theta": (12345.0, 54321.0),
    "rope_scaling_factor": (8.0, 4.0),
    "rope_scaling_type": ("llama3", "yarn"),
    "rope_beta_fast": (16.0, 8.0),
    "rope_beta_slow": (2.0, 0.5),
    "rope_low_freq_factor": (2.0, 1.5),
    "rope_high_freq_factor": (8.0, 6.0),
    "rope_original_max_seq_len": (1024, 2048),
    "rope_yarn_truncate": (False, True),
    "max_seq_len": (4096, 1024),
    "tie_word_embeddings": (True, False),
    "attn_mask_type": ("block_causal", "causal"),
    "moe.num_experts": (16, 4),
    "moe.top_k": (1, 3),
    "moe.hidden_dim": (24, 40),
    "moe.num_shared_experts": (2, 1),
    "moe.n_dense_layers": (2, 1),
    "moe.score_func": ("sigmoid", "softmax"),
    "moe.route_norm": (False, True),
    "moe.route_scale": (1.5, 2.0),
    "moe.n_groups": (2, 4),
    "moe.topk_groups": (2, 1),
    "moe.load_balance_coeff": (0.01, 0.02),
    "moe.aux_loss_coeff": (0.01, 0.02),
    "moe.aux_loss_over": ("each_layer", "all_layers"),
    "moe.bias": (True, False),
    "moe.swiglu_limit": (5.0, 3.0),
    "sliding_window": (64, 32),
    "mla.kv_lora_rank": (24, 48),
    "mla.q_lora_rank": (16, 0),
    "mla.qk_nope_head_dim": (24, 8),
    "mla.qk_rope_head_dim": (8, 16),
    "mla.v_head_dim": (24, 8),
    "mla.mscale": (0.5, 2.0),
}


def leaf_keys(section: object, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        keys += leaf_keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [f"{prefix}{f.name}"]
    return keys


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Each option's model as a folder's config.json, as its family's format writes it."""
    root = tmp_path_factory.mktemp("hf_folders")
    written = {}
    for option in FOLDERS:
        model = resolve(compose_job_config([f"model={option}", *ONE_RANK]), place=False).config.model
        folder = root / option
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(family_of(model).hf.hf_config(model, "float32")))
        written[option] = folder
    return written


@pytest.fixture(scope="module")
def composed(folders) -> dict[str, JobConfig]:
    """Each folder's job as `model=hf model.hf_path=<folder>` composes it (composed once: a key is
    then set on the composed section as the command line would, config/compose.py's part being
    test_the_command_lines_model_keys_apply_over_the_folder's)."""
    return {
        option: compose_job_config(["model=hf", f"model.hf_path={folder}", *ONE_RANK])
        for option, folder in folders.items()
    }


def weight_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in build_model(model).named_parameters()}


def resolved_model(folder: Path, *overrides: str) -> ModelConfig:
    cfg = compose_job_config(["model=hf", f"model.hf_path={folder}", *ONE_RANK, *overrides])
    return resolve(cfg, place=False).config.model


def with_key(composed: JobConfig, key: str, value: object) -> JobConfig:
    """The composed job with model.`key` set to `value`, as `model.<key>=<value>` on the command line sets it."""
    cfg = copy.deepcopy(composed)
    section, _, leaf = key.rpartition(".")
    setattr(attrgetter(section)(cfg.model) if section else cfg.model, leaf, value)
    cfg.model.keys_set = (key,)
    return cfg


def cases() -> list[tuple[str, str]]:
    keys = {option: leaf_keys(FAMILIES[option.split("_debug")[0].removesuffix("_moe")].config()) for option in FOLDERS}
    return [(option, key) for option, names in keys.items() for key in names if key not in NOT_SET]


def test_every_key_of_every_family_has_values_to_try():
    assert {key for _, key in cases()} <= set(CANDIDATES)


@pytest.mark.parametrize("option,key", cases(), ids=lambda v: v)
def test_a_key_set_beside_model_hf_applies_over_the_folder_or_is_refused_for_changing_a_shape(
    folders, composed, option, key
):
    folder = folders[option]
    theirs = resolve(composed[option], place=False).config.model
    their_value = attrgetter(key)(theirs)
    value = next(v for v in CANDIDATES[key] if v != their_value)
    section, _, leaf = key.rpartition(".")
    if section:
        changed = dataclasses.replace(
            theirs, **{section: dataclasses.replace(getattr(theirs, section), **{leaf: value})}
        )
    else:
        changed = dataclasses.replace(theirs, **{leaf: value})
    cfg = with_key(composed[option], key, value)
    try:
        changed.check("model")
    except ConfigError as err:  # the key's own rules refuse the value: so must model=hf
        with pytest.raises(ConfigError, match=f"^{err.key}="):
            resolve(cfg, place=False)
        return
    if weight_shapes(changed) != weight_shapes(theirs):
        with pytest.raises(ConfigError) as refused:
            resolve(cfg, place=False)
        # Said as a change of shape, or where the folder's format lists no such weight, of architecture.
        assert str(refused.value).startswith(
            f"model.{key}={value}: drop it: {folder}'s config.json gives {their_value}, "
        )
        return
    hf = family_of(theirs).hf
    if (why := hf.refusal(changed)) and hf.refusal(theirs) is None:  # another architecture than the folder's
        with pytest.raises(ConfigError) as refused:
            resolve(cfg, place=False)
        given = f"{folder}'s config.json gives {their_value}"
        assert str(refused.value) == f"model.{key}={value}: drop it: {given}, and its format holds no other ({why})"
        return
    job = resolve(cfg, place=False)
    assert attrgetter(key)(job.config.model) == value
    assert job.params()[f"model.{key}"] == value  # what MLflow records and `show` prints
    assert dataclasses.replace(job.config.model, flavor=theirs.flavor) == changed  # nothing else moved


def test_the_command_lines_model_keys_apply_over_the_folder(folders):
    """The user's case: a Qwen3-MoE folder, documents kept apart and the auxiliary loss on."""
    folder = folders["qwen3_moe_debug"]
    model = resolved_model(folder, "model.attn_mask_type=block_causal", "model.moe.aux_loss_coeff=0.01")
    assert (model.attn_mask_type, model.moe.aux_loss_coeff, model.dim) == ("block_causal", 0.01, 256)
    with pytest.raises(ConfigError, match=f"^model.dim=128: drop it: {folder}'s config.json gives 256, "):
        resolved_model(folder, "model.dim=128")
    assert resolved_model(folder, "model.dim=256").dim == 256  # the folder's own value is no change


@pytest.mark.parametrize("override", ["model.sliding_window=64", "model.mla.kv_lora_rank=24"])
def test_a_key_of_another_family_is_refused_naming_the_folders(folders, override):
    with pytest.raises(ConfigError) as refused:
        resolved_model(folders["qwen3_moe_debug"], override)
    assert str(refused.value) == f"{override}: is not a key of qwen3 models, which {folders['qwen3_moe_debug']} holds"


def test_keys_set_together_are_checked_together(folders):
    """Grouped routing's two keys, each of which alone would break the rule between them."""
    folder = folders["deepseek_v3_debug"]
    model = resolved_model(folder, "model.moe.n_groups=1", "model.moe.topk_groups=1")
    assert (model.moe.n_groups, model.moe.topk_groups) == (1, 1)
    with pytest.raises(ConfigError, match=r"^model.moe.topk_groups=2: must lie in \[1, model.moe.n_groups=1\]"):
        resolved_model(folder, "model.moe.n_groups=1")  # the folder's topk_groups, 2, kept


def test_an_experiments_keys_apply_over_the_folder_too(folders, tmp_path, monkeypatch):
    """Keys set in a file (the user's own experiment) rather than on the command line."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: hf\n"
        "model:\n  attn_mask_type: block_causal\n  max_seq_len: 2048\n"
    )
    monkeypatch.setenv("TITAN_EXP_CONFIG_DIR", str(tmp_path))
    # The folder says 4,096 positions; the experiment's 2,048 is the schema's default, set all the same.
    assert resolved_model(folders["qwen3_debug"]).max_seq_len == 4096
    model = resolved_model(folders["qwen3_debug"], "experiment=mine")
    assert (model.attn_mask_type, model.max_seq_len, model.dim) == ("block_causal", 2048, 256)


def test_a_plan_of_a_folder_reads_no_data_and_a_job_is_told_to_read_the_models_own_tokens(folders, tmp_path):
    """A vocabulary smaller than data=text's BPE: nothing a plan reads, a training job's to fix."""
    small = tmp_path / "small-vocab"
    small.mkdir()
    config = json.loads((folders["qwen3_moe_debug"] / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 512}))
    cfg = compose_job_config(["model=hf", f"model.hf_path={small}", *ONE_RANK])
    assert resolve(cfg, place=False).config.model.vocab_size == 512  # as `titan_exp plan` resolves it
    with pytest.raises(ConfigError) as refused:
        resolve(cfg, room=False)
    assert str(refused.value) == (
        "data.tokenizer_vocab_size=2048: must lie in [1, model vocab_size=512] of qwen3_small-vocab; train on the "
        "model's own tokens (data=files data.paths=[...] data.tokenizer_path=<its tokenizer.json>) or lower it"
    )


def test_a_folders_run_is_named_as_the_docs_say(folders, tmp_path):
    """docs/running.md names the run of a Llama folder; the run's name is what it says."""
    named = tmp_path / "Llama-3.2-1B"
    named.mkdir()
    (named / "config.json").write_text((folders["llama3_debug"] / "config.json").read_text())
    said = re.search(r"is named after the family and the folder \(`([^`]+)`\)", DOCS.read_text().replace("\n  ", " "))
    cfg = compose_job_config(["model=hf", f"model.hf_path={named}", "parallelism=fsdp_tp", "launcher.nproc_per_node=4"])
    assert resolve(cfg, place=False).run_name() == said.group(1)

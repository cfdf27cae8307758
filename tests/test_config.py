"""Every config option composes through Hydra's compose API; every rule of config/check.py fires."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from titan_exp.config.compose import to_job_config
from titan_exp.config.resolve import resolve
from titan_exp.config.schema import JobConfig
from titan_exp.job.preflight import preflight
from titan_exp.models.registry import build_model
from titan_exp.rules import ConfigError

from conftest import CONF_DIR, compose_config

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_into_the_schema(group: str, option: str):
    cfg = OmegaConf.to_object(compose_config([f"{group}={option}"]))
    assert isinstance(cfg, JobConfig)


def test_all_groups_have_options():
    expected = {
        "model",
        "parallelism",
        "quantize",
        "profiling",
        "training",
        "data",
        "optimizer",
        "launcher",
        "tracking",
        "debug",
        "experiment",
        "hardware",
    }
    assert expected <= set(GROUPS)
    assert all(options(g) for g in GROUPS)


PUBLISHED_PARAMS = {
    "llama3_1b": 1_235_814_400,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_405b": 405_853_388_800,
}


@pytest.mark.parametrize("flavor,count", sorted(PUBLISHED_PARAMS.items()))
def test_model_flavors_have_published_parameter_counts(flavor: str, count: int):
    import torch

    cfg = OmegaConf.to_object(compose_config([f"model={flavor}"]))
    with torch.device("meta"):
        assert build_model(cfg.model).num_params() == count


def resolved(overrides: list[str]) -> JobConfig:
    """The resolved job's config, once the pre-flight passed."""
    job = resolve(to_job_config(compose_config(overrides)))
    preflight(job)
    return job.config


def test_inferred_degree_fills_the_world():
    four_ranks = ["launcher.nproc_per_node=4", "launcher.oversubscribe=true"]
    cfg = resolved(["parallelism=hsdp", *four_ranks, "launcher.device=cpu"])
    assert (cfg.parallelism.data_parallel_replicate_degree, cfg.parallelism.data_parallel_shard_degree) == (2, 2)
    assert cfg.training.global_batch_size == cfg.training.local_batch_size * 4


def test_single_layout_places_one_rank_by_default():
    cfg = resolved(["parallelism=single"])
    assert (cfg.launcher.nproc_per_node, cfg.launcher.nodes) == (1, 1)


def test_accumulation_is_accepted_for_a_multiple_of_the_microbatch():
    cfg = resolved(["launcher.nproc_per_node=2", "training.local_batch_size=2", "training.global_batch_size=8"])
    assert cfg.training.global_batch_size == 8


BAD = OmegaConf.to_container(OmegaConf.load(Path(__file__).with_name("bad_configs.yaml")))


@pytest.mark.parametrize("case", BAD, ids=[f"{case['key']}:{case['overrides'][-1]}" for case in BAD])
def test_bad_config_names_key_value_and_fix(case: dict):
    overrides = case["overrides"]
    with pytest.raises(ConfigError) as err:
        resolved(["launcher.device=cpu", *overrides] if "launcher.device=cuda" not in overrides else overrides)
    assert err.value.key == case["key"]
    assert case["fix"] in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("content,fix", [(b"", "empty"), (b"\x00\x01\xff\xfe", "not UTF-8"), (b"ab\x00cd", "binary")])
def test_a_corpus_that_is_not_text_is_refused_before_training(tmp_path: Path, content: bytes, fix: str):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(content)
    with pytest.raises(ConfigError, match=fix) as err:
        resolved(["launcher.device=cpu", f"data.corpus_path={corpus}"])
    assert err.value.key == "data.corpus_path"


@pytest.mark.parametrize(
    "override,hint",
    [
        ("launcher.partition=gpu", "is read by launcher=slurm only"),
        ("model.mla.kv_lora_rank=64", "is read by model=deepseek_v3_16b|deepseek_v3_671b|deepseek_v3_debug|hf only"),
        ("training.stepz=3", "did you mean training.steps?"),
    ],
)
def test_a_key_the_option_lacks_names_where_it_is_read(override: str, hint: str):
    """Another option's key (an engine's, a model family's) or a typo: the one line says where it is read."""
    from hydra.errors import HydraException

    from titan_exp.job.outcome import composition_error

    with pytest.raises(HydraException) as err:
        compose_config([override])
    assert hint in composition_error(err.value)


@pytest.mark.parametrize("key", ["launcher.partition", "launcher.additional_parameters", "tracking.run_name"])
def test_a_line_break_in_a_value_for_the_batch_script_is_refused(key: str):
    """A newline in a value from a YAML file would add #SBATCH and shell lines to the rendered script."""
    composed = compose_config(["launcher=slurm", "launcher.nproc_per_node=1", "launcher.device=cpu"])
    value = {"mail": "x\n#SBATCH --uid=0"} if key.endswith("parameters") else "debug\nrm -rf ~"
    OmegaConf.update(composed, key, value, merge=False)
    with pytest.raises(ConfigError, match="line break") as err:
        resolve(to_job_config(composed))
    assert err.value.key == key


FILES = ["data=files", "data.paths=[d.jsonl]", "data.tokenizer_path=t.json"]


def said_before_start(overrides: list[str]) -> list[str]:
    """The cautions `python -m titan_exp` says for these overrides."""
    from titan_exp.config.check import cautions

    cfg = to_job_config(compose_config(["launcher.device=cpu", *overrides]))
    return cautions(cfg, resolve(cfg).dims)


def test_a_warmup_longer_than_the_run_is_said_before_it_starts_where_someone_chose_it():
    assert said_before_start(["lr_scheduler.warmup_steps=10", "training.steps=20"]) == []
    (said,) = said_before_start(["lr_scheduler.warmup_steps=100", "training.steps=10"])
    assert "lr_scheduler.warmup_steps=100 exceeds training.steps=10" in said
    assert said_before_start(["training.steps=3"]) == []  # the default warmup on a short smoke run: as meant


@pytest.mark.parametrize(
    "overrides,key,why",
    [
        (["parallelism.pipeline_parallel_schedule=GPipe"], "pipeline_parallel_schedule=GPipe", "degree is 1"),
        (["parallelism=tp", "parallelism.context_parallel_impl=allgather"], "context_parallel_impl", "degree is 1"),
        (["parallelism=ddp", "parallelism.fsdp_reshard_after_forward=never"], "fsdp_reshard_after_forward", "FSDP"),
        (
            ["activation_checkpoint.selective_ac_option=2"],
            "activation_checkpoint.selective_ac_option=2",
            "mode is none",
        ),
        (["compile.backend=eager"], "compile.backend=eager", "compile.enable is false"),
        (["quantize.recipe=tensorwise"], "quantize.recipe=tensorwise", "quantize=none"),
        (["data=synthetic", "data.tokenizer_vocab_size=512"], "data.tokenizer_vocab_size=512", "source is synthetic"),
        (["data.tokenizer_path=t.json", "data.tokenizer_vocab_size=512"], "tokenizer_vocab_size=512", "tokenizer_path"),
        (["data.text_field=body"], "data.text_field=body", "source is text"),
        (
            [*FILES, "validation.enable=true", "validation.paths=[v.jsonl]", "validation.held_out_fraction=0.1"],
            "validation.held_out_fraction=0.1",
            "validation.paths is set",
        ),
    ],
)
def test_a_key_this_layout_does_not_read_is_said_before_it_starts(overrides: list[str], key: str, why: str):
    (said,) = said_before_start(overrides)
    assert key in said and "has no effect" in said and why in said


def test_keys_the_layout_reads_are_not_cautioned():
    assert said_before_start(["parallelism=pp", "parallelism.pipeline_parallel_schedule=GPipe"]) == []
    selective = ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=2"]
    assert said_before_start(selective) == []
    assert said_before_start(["parallelism=tp", "parallelism.enable_async_tensor_parallel=false"]) == []  # the default


def test_a_checkpoint_folder_without_room_for_one_checkpoint_is_refused(tmp_path: Path, monkeypatch):
    import shutil

    folder = tmp_path / "ckpt"
    overrides = ["launcher.device=cpu", "checkpoint.enable=true", f"checkpoint.folder={folder}"]
    resolved(overrides)  # this disk has room for the debug model's weights and AdamW's moments
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(ConfigError, match="needs 0.06 GiB") as err:
        resolved(overrides)
    assert err.value.key == "checkpoint.folder"


def test_a_parent_run_the_store_does_not_have_is_refused(tmp_path: Path):
    from titan_exp.tracking.config import TrackingConfig
    from titan_exp.tracking.run import MlflowRun

    uri = f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(ConfigError, match="no such run") as err:
        resolved(["launcher.device=cpu", uri, "tracking.parent_run_id=0123abcd"])  # no store yet
    assert err.value.key == "tracking.parent_run_id"
    parent = MlflowRun.create(TrackingConfig(uri=uri.split("=", 1)[1]), "parent", {})
    with pytest.raises(ConfigError, match="no such run"):
        resolved(["launcher.device=cpu", uri, "tracking.parent_run_id=0123abcd"])
    resolved(["launcher.device=cpu", uri, f"tracking.parent_run_id={parent.run_id}"])

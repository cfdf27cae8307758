"""Every config option composes through Hydra's compose API; every rule of config.check fires."""

import pytest
from omegaconf import OmegaConf

from conftest import CONF_DIR, compose_config
from titan_exp.config.check import ConfigError
from titan_exp.config.schema import JobConfig
from titan_exp.job import prepare
from titan_exp.models.llama3.model import Transformer

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_into_the_schema(group: str, option: str):
    cfg = OmegaConf.to_object(compose_config([f"{group}={option}"]))
    assert isinstance(cfg, JobConfig)


def test_all_groups_have_options():
    expected = {"model", "parallelism", "quantize", "profiling", "training", "data", "optimizer", "launcher", "tracking", "debug", "experiment"}
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
        assert Transformer(cfg.model).num_params() == count


def resolved(overrides: list[str]) -> JobConfig:
    return prepare(OmegaConf.to_object(compose_config(overrides)))[0]


def test_inferred_degree_fills_the_world():
    cfg = resolved(["parallelism=hsdp", "launcher.nproc_per_node=4", "launcher.device=cpu"])
    assert (cfg.parallelism.data_parallel_replicate_degree, cfg.parallelism.data_parallel_shard_degree) == (2, 2)
    assert cfg.training.global_batch_size == cfg.training.local_batch_size * 4


def test_single_layout_places_one_rank_by_default():
    cfg, placement = prepare(OmegaConf.to_object(compose_config(["parallelism=single"])))
    assert placement.world_size == 1


def test_accumulation_is_accepted_for_a_multiple_of_the_microbatch():
    cfg = resolved(["launcher.nproc_per_node=2", "training.local_batch_size=2", "training.global_batch_size=8"])
    assert cfg.training.global_batch_size == 8


BAD = [
    (["parallelism=fsdp", "parallelism.data_parallel_shard_degree=3", "launcher.nproc_per_node=2"], "parallelism", "world size is 2"),
    (["parallelism=hsdp", "launcher.nproc_per_node=3"], "parallelism.data_parallel_shard_degree", "does not divide the world size 3"),
    (["parallelism.data_parallel_replicate_degree=-1", "launcher.nproc_per_node=2"], "parallelism.data_parallel_shard_degree", "only one degree may be -1"),
    (["parallelism.tensor_parallel_degree=3", "parallelism.data_parallel_shard_degree=1", "launcher.nproc_per_node=3"], "parallelism.tensor_parallel_degree", "must divide model n_heads=16"),
    (["parallelism.tensor_parallel_degree=8", "parallelism.data_parallel_shard_degree=1", "launcher.nproc_per_node=8"], "parallelism.tensor_parallel_degree", "must divide model n_kv_heads=4"),
    (["parallelism=pp", "launcher.nproc_per_node=4", "parallelism.pipeline_parallel_schedule=Interleaved1F1B", "training.local_batch_size=4"], "parallelism.pipeline_parallel_degree", "8 stages cannot be spread over 4 ranks and 6 layers"),
    (["parallelism=pp", "launcher.nproc_per_node=2", "parallelism.pipeline_parallel_layers_per_stage=4"], "parallelism.pipeline_parallel_layers_per_stage", "must divide model n_layers=6"),
    (["parallelism=pp", "launcher.nproc_per_node=2", "parallelism.pipeline_parallel_layers_per_stage=1"], "parallelism.pipeline_parallel_layers_per_stage", "1F1B runs one stage per rank"),
    (["parallelism=pp", "launcher.nproc_per_node=2", "parallelism.pipeline_parallel_schedule=Zigzag"], "parallelism.pipeline_parallel_schedule", "choose one of"),
    (["parallelism=pp", "launcher.nproc_per_node=2", "parallelism.pipeline_parallel_microbatch_size=3"], "parallelism.pipeline_parallel_microbatch_size", "must divide training.local_batch_size=4"),
    (["parallelism=pp", "launcher.nproc_per_node=4", "training.local_batch_size=2"], "training.local_batch_size", "fewer than the 4 pipeline ranks"),
    (["parallelism=pp", "launcher.nproc_per_node=2", "parallelism.pipeline_parallel_schedule=DualPipeV", "training.local_batch_size=2"], "training.local_batch_size", "DualPipeV needs at least one per stage (4)"),
    (["parallelism=pp", "launcher.nproc_per_node=2", "training.global_batch_size=8"], "training.global_batch_size", "do not combine yet"),
    (["parallelism=pp", "launcher.nproc_per_node=2", "model=llama3_1b", "training.local_batch_size=2"], "parallelism.pipeline_parallel_degree", "ties its embeddings"),
    (["parallelism=tp", "launcher.nproc_per_node=2", "training.seq_len=255"], "parallelism.tensor_parallel_degree", "must divide training.seq_len=255"),
    (["parallelism=tp", "launcher.nproc_per_node=2", "parallelism.enable_async_tensor_parallel=true"], "parallelism.enable_async_tensor_parallel", "needs compile.enable=true"),
    (["parallelism=tp", "launcher.nproc_per_node=2", "parallelism.enable_async_tensor_parallel=true", "compile.enable=true"], "parallelism.enable_async_tensor_parallel", "needs CUDA"),
    (["parallelism.enable_async_tensor_parallel=true", "launcher.nproc_per_node=2"], "parallelism.enable_async_tensor_parallel", "tensor_parallel_degree > 1"),
    (["launcher.nproc_per_node=2", "checkpoint.create_seed_checkpoint=true"], "checkpoint.create_seed_checkpoint", "add parallelism=single"),
    (["checkpoint.initial_load_path=/nonexistent/step-0"], "checkpoint.initial_load_path", "not a checkpoint folder"),
    (["checkpoint=periodic", "checkpoint.interval=0"], "checkpoint.interval", "must be > 0"),
    (["launcher.nproc_per_node=2", "training.global_batch_size=6"], "training.global_batch_size", "multiple of local_batch_size"),
    (["parallelism=fsdp_cp", "launcher.nproc_per_node=4"], "parallelism.context_parallel_degree", "no context-parallel attention for CPU"),
    (["parallelism=fsdp_cp", "launcher.nproc_per_node=4", "training.seq_len=250"], "parallelism.context_parallel_degree", "2 × it must divide training.seq_len=250"),
    (["parallelism=fsdp_cp", "launcher.nproc_per_node=4", "parallelism.pipeline_parallel_degree=2", "parallelism.data_parallel_shard_degree=1"], "parallelism.context_parallel_degree", "does not combine with pipeline"),
    (["parallelism=tp", "launcher.nproc_per_node=2", "quantize=mxfp8"], "quantize", "mxfp8 under tensor parallelism"),
    (["training.steps=0"], "training.steps", "must be > 0"),
    (["training.steps=-3"], "training.steps", "must be > 0"),
    (["training.seq_len=4096"], "training.seq_len", "exceeds model max_seq_len=2048"),
    (["training.mixed_precision_param=fp8"], "training.mixed_precision_param", "choose one of"),
    (["activation_checkpoint.mode=partial"], "activation_checkpoint.mode", "choose one of"),
    (["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=every"], "activation_checkpoint.selective_ac_option", "positive integer"),
    (["lr_scheduler.decay_type=step"], "lr_scheduler.decay_type", "choose one of"),
    (["data.tokenizer_vocab_size=4096"], "data.tokenizer_vocab_size", "model vocab_size=2048"),
    (["data.corpus_path=/nonexistent/corpus.txt"], "data.corpus_path", "no such file"),
    (["launcher.nproc_per_node=0"], "launcher.nproc_per_node", "positive count"),
    (["launcher.device=cuda"], "launcher.device", "no GPU is visible"),
]


@pytest.mark.parametrize("overrides,key,fix", BAD, ids=[b[1] + ":" + b[0][-1] for b in BAD])
def test_bad_config_names_key_value_and_fix(overrides: list[str], key: str, fix: str):
    with pytest.raises(ConfigError) as err:
        resolved(["launcher.device=cpu", *overrides] if "launcher.device=cuda" not in overrides else overrides)
    assert err.value.key == key
    assert fix in str(err.value)
    assert "\n" not in str(err.value)

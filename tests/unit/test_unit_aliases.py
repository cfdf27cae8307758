"""torchtitan's key names of today (config/aliases.py) land in ours, converted where the units
differ; an unknown key is refused with the closest known one (config/compose.py)."""

import pytest

from titan_exp.config.compose import compose_job_config, unknown_key_fix
from titan_exp.config.resolve import resolve
from titan_exp.rules import ConfigError

CPU = ["launcher.device=cpu"]


def resolved(overrides: list[str]):
    return resolve(compose_job_config([*CPU, *overrides])).config


def test_token_counts_become_sequences():
    cfg = resolved([
        "training.max_context_length=512",
        "training.num_tokens_per_microbatch_per_dp_rank=1024",
        "training.num_tokens_per_train_step=8192",
    ])  # fmt: skip
    t = cfg.training
    assert (t.seq_len, t.local_batch_size, t.global_batch_size) == (512, 2, 16)
    # Nothing is left under torchtitan's names: the resolved job speaks one set of names.
    assert (t.max_context_length, t.num_tokens_per_microbatch_per_dp_rank, t.num_tokens_per_train_step) == (None,) * 3


def test_a_pipelined_microbatch_is_torchtitans_forward():
    cfg = resolved([
        "parallelism=pp",
        "training.num_tokens_per_microbatch_per_dp_rank=512",
        "parallelism.num_pp_microbatches=4",
    ])  # fmt: skip
    assert cfg.training.local_batch_size == 8 and cfg.parallelism.pipeline_parallel_microbatch_size == 2


def test_num_pp_microbatches_alone_splits_the_local_batch():
    cfg = resolved(["parallelism=pp", "training.local_batch_size=8", "parallelism.num_pp_microbatches=4"])
    assert cfg.parallelism.pipeline_parallel_microbatch_size == 2


def test_renamed_keys_land_in_ours():
    cfg = resolved(["comm.mode=default", "compile.enable_async_tensor_parallel=false"])
    assert cfg.debug.comm_mode == "real" and cfg.comm.mode is None
    assert cfg.compile.enable_async_tensor_parallel is None and cfg.parallelism.enable_async_tensor_parallel is False


@pytest.mark.parametrize(
    "overrides,key,said",
    [
        (["training.num_tokens_per_microbatch_per_dp_rank=1000"], "training.num_tokens_per_microbatch_per_dp_rank",
         "multiple of training.seq_len=256"),
        (["training.max_context_length=512", "training.seq_len=128"], "training.max_context_length", "one of them"),
        (["parallelism=pp", "parallelism.num_pp_microbatches=3"], "parallelism.num_pp_microbatches", "must divide"),
        (["comm.mode=torchcomms"], "comm.mode", "choose one of default, fake_backend, local_tensor"),
    ],
)  # fmt: skip
def test_values_that_do_not_convert_are_refused(overrides, key, said):
    with pytest.raises(ConfigError, match=said) as err:
        resolved(overrides)
    assert err.value.key == key


@pytest.mark.parametrize(
    "key,suggested",
    [
        ("training.stepz", "training.steps"),
        ("training.local_batch", "training.local_batch_size"),
        ("training.tensor_parallel_degree", "parallelism.tensor_parallel_degree"),
        ("traning.steps", "training.steps"),
        ("parallelism.pipeline_parallel_degre", "parallelism.pipeline_parallel_degree"),
    ],
)
def test_an_unknown_key_gets_the_closest_known_one(key, suggested):
    assert unknown_key_fix(key).endswith(f"did you mean {suggested}?")


def test_nothing_close_is_not_guessed():
    assert "did you mean" not in unknown_key_fix("training.zzzzqq")
    assert "did you mean" not in unknown_key_fix("training.dtype")

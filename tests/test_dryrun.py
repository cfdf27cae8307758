"""COMM_MODE=fake_backend: configs far beyond this machine, validated and sized in one process (the
dry run itself, in this test's process; the command line's path to it once)."""

import re

import pytest
import torch

from titan_exp.config.compose import to_job_config
from titan_exp.config.resolve import resolve
from titan_exp.rules import ConfigError
from titan_exp.train.dry_run import fake_backend_dry_run, local_tensor_run

from conftest import compose_config, run_cli


def dry_run(overrides: list[str]) -> dict:
    """Rank 0's report of the fake_backend dry run of a config, run in this process."""
    return fake_backend_dry_run(resolve(to_job_config(compose_config([*overrides, "debug.comm_mode=fake_backend"]))))


def report_of(stdout: str) -> dict[str, str]:
    line = next(line for line in stdout.splitlines() if line.startswith("dry run (fake_backend)"))
    return dict(re.findall(r"(\w+)=(\S+)", line.split(":", 1)[1]))


def test_llama3_405b_on_512_ranks_fsdp8_tp8_pp8():
    report = dry_run(
        [
            "model=llama3_405b",
            "parallelism=fsdp_tp_pp",
            "parallelism.tensor_parallel_degree=8",
            "parallelism.pipeline_parallel_degree=8",
            "launcher.nproc_per_node=8",
            "launcher.nodes=64",
            "training.seq_len=8192",
            "training.local_batch_size=8",
            "training.mixed_precision_param=bfloat16",
            "activation_checkpoint.mode=full",
            "tracking=none",
        ]
    )
    assert report["world_size"] == 512 and report["mesh"] == "pp8·dp_shard8·tp8"
    assert report["total_params"] == 405_853_388_800
    # Rank 0 holds stage 0 (embeddings + layers 0..14 of 126), every weight split 64 ways
    # (FSDP 8 × TP 8) except the norms, which TP replicates.
    from titan_exp.models.config import ModelConfig
    from titan_exp.models.registry import build_model

    cfg = ModelConfig(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        max_seq_len=16,
    )
    with torch.device("meta"):
        model = build_model(cfg)
    stage0 = [("tok_embeddings.weight", model.tok_embeddings.weight)] + [
        (name, p) for name, p in model.named_parameters() if name.startswith("layers.") and int(name.split(".")[1]) < 15
    ]
    expected = sum(p.numel() // (8 if "norm" in name else 64) for name, p in stage0)
    assert report["rank0_params"] == expected
    assert report["rank0_optimizer_state_gib"] == pytest.approx(expected * 8 / 1024**3, rel=1e-3)
    assert 0 < report["rank0_step_peak_activation_gib"]
    assert report["rank0_estimated_peak_gib"] > report["rank0_optimizer_state_gib"]


def test_config_key_selects_the_dry_run_on_the_command_line_and_fsdp_halves_the_params(tmp_path):
    result = run_cli(
        ["debug.comm_mode=fake_backend", "parallelism=fsdp", "launcher.nproc_per_node=2", "tracking=none"], tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = report_of(result.stdout)
    assert int(report["rank0_params"].replace(",", "")) * 2 == int(report["total_params"].replace(",", ""))
    assert "loss" not in result.stdout  # nothing trained


def test_context_parallel_dry_run_holds_a_slice_of_the_activations_and_the_gathered_kv():
    """Debug model at seq 2048 on 4 ranks: cp=2 keeps half the activations of its fsdp4 twin, plus
    the other rank's K and V each attention layer gathered (estimate/memory.py's count of them)."""
    from titan_exp.estimate.memory import gathered_kv
    from titan_exp.models.config import ModelConfig
    from titan_exp.units import GIB

    activations = {}
    for cp in (1, 2):
        args = ["parallelism=fsdp_cp", f"parallelism.context_parallel_degree={cp}", "launcher.nproc_per_node=4"]
        report = dry_run([*args, "training.seq_len=2048", "training.local_batch_size=1", "tracking=none"])
        assert report["mesh"] == ("dp_shard4" if cp == 1 else "dp_shard2·cp2")
        activations[cp] = report["rank0_step_peak_activation_gib"]
    debug = ModelConfig()
    kv = debug.n_layers * gathered_kv(debug, 1, 2048, 2) * 4 / GIB
    assert activations[2] == pytest.approx(activations[1] / 2 + kv, rel=0.1), (activations, kv)


def test_dry_run_needs_the_world_spelled_out(monkeypatch):
    monkeypatch.setenv("COMM_MODE", "fake_backend")  # the environment's word wins over the config's
    with pytest.raises(ConfigError, match="launcher.nproc_per_node=-1: a dry run needs the world spelled out"):
        resolve(to_job_config(compose_config(["parallelism=fsdp", "tracking=none"])))


def test_local_tensor_mode_reproduces_real_tensor_parallel_ranks(tmp_path, store):
    from conftest import SMALL_MODEL, loss_curve, mlflow_runs

    uri, db = store
    common = ["experiment=smoke", "parallelism=tp", "launcher.nproc_per_node=2", "debug=deterministic", *SMALL_MODEL]
    per_step = local_tensor_run(resolve(to_job_config(compose_config([*common, "debug.comm_mode=local_tensor"]))))
    assert len(per_step) == 6 and all(len(ranks) == 2 and ranks[0] == ranks[1] for ranks in per_step)
    real = run_cli([*common, "tracking=mlflow", uri], tmp_path / "real")
    assert real.returncode == 0, real.stderr[-3000:]
    real_curve = loss_curve(db, mlflow_runs(db)[0].info.run_id)
    torch.testing.assert_close([ranks[0] for ranks in per_step], real_curve, rtol=1e-4, atol=0)


def test_local_tensor_mode_refuses_fsdp_by_name(monkeypatch):
    monkeypatch.setenv("COMM_MODE", "local_tensor")
    with pytest.raises(ConfigError, match="LocalTensorMode fails inside FSDP2"):
        resolve(to_job_config(compose_config(["experiment=smoke", "parallelism=fsdp", "launcher.nproc_per_node=2"])))


@pytest.mark.parametrize(
    "layout,mesh,tp",
    [
        (["parallelism.expert_parallel_degree=32"], "pp8·dp_shard32·ep32", 1),
        # TP splitting each expert: EP borrows from FSDP's ranks only, the experts 2D-sharded.
        (
            [
                "parallelism.tensor_parallel_degree=4",
                "parallelism.expert_parallel_degree=8",
                "parallelism.expert_tensor_parallel_degree=4",
            ],
            "pp8·dp_shard8·tp4·ep8·etp4",
            4,
        ),
    ],
    ids=["fsdp32·ep32", "fsdp8·tp4·ep8·etp4"],
)
def test_deepseek_v3_671b_on_256_ranks_pp8(layout, mesh, tp):
    """DeepSeek-V3 on 32 nodes of 8 GPUs: 8 pipeline stages, each over 32 ranks that FSDP-shard
    the dense weights and split the 256 routed experts 32 ways: 8 whole experts each, or 32 by a
    quarter of their hidden dim each; the fake tokens routed evenly."""
    report = dry_run(
        [
            "model=deepseek_v3_671b",
            "parallelism=fsdp_pp",
            "parallelism.pipeline_parallel_degree=8",
            *layout,
            "launcher.nproc_per_node=8",
            "launcher.nodes=32",
            "training.local_batch_size=8",
            "training.mixed_precision_param=bfloat16",
            "tracking=none",
        ]
    )
    assert report["world_size"] == 256 and report["mesh"] == mesh
    assert report["total_params"] == 671_026_404_352
    # Stage 0: the embeddings, the 3 dense layers and 4 MoE layers (61 layers over 8 stages, the
    # first getting 7). Each MoE layer's routed experts: 1/32 of them on this rank (EP leaves no
    # data-parallel rank to shard them over); everything else FSDP-sharded (× TP) 32 ways: 1/32 of all.
    from titan_exp.config.compose import compose_job_config
    from titan_exp.models.registry import build_model

    with torch.device("meta"):
        model = build_model(compose_job_config(["model=deepseek_v3_671b"]).model)
    stage0 = [("tok_embeddings.weight", model.tok_embeddings.weight)] + [
        (name, p) for name, p in model.named_parameters() if name.startswith("layers.") and int(name.split(".")[1]) < 7
    ]
    # Under TP: the weights it keeps whole on every tp rank (the norms, the router, the latent
    # down-projections) are FSDP-sharded 8 ways only.
    whole_under_tp = ("norm", "router", "wq_a", "wkv_a")
    expected = sum(p.numel() // (32 // tp if any(w in n for w in whole_under_tp) else 32) for n, p in stage0)
    assert report["rank0_params"] == expected


def test_the_dry_run_steps_through_every_microbatch_and_counts_what_they_leave():
    """FSDP over 8 ranks, 4 microbatches: reducing each, rank 0 carries its eighth of the float32
    gradients from one microbatch to the next; reducing after the last only, every unit's
    unsharded gradient (the whole model's, 4 B a parameter): 7/8 of them more at its peak."""
    shape = ["parallelism=fsdp", "launcher.nproc_per_node=8", "training.local_batch_size=1", "tracking=none"]
    one = dry_run([*shape, "training.global_batch_size=8"])
    every, last = (
        dry_run([*shape, "training.global_batch_size=32", f"training.gradient_sync={sync}"])
        for sync in ("every_microbatch", "last_microbatch")
    )
    params = one["total_params"]
    assert "rank0_step_peak_sharded_grad_gib" not in one  # one microbatch: its gradients come after the peak
    assert every["rank0_step_peak_sharded_grad_gib"] == pytest.approx(params * 4 / 8 / 2**30, rel=0.01)
    gained = last["rank0_step_peak_total_gib"] - every["rank0_step_peak_total_gib"]
    assert gained == pytest.approx(params * 4 * 7 / 8 / 2**30, rel=0.02)

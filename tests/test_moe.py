"""Qwen3, DeepSeek-V3 and GPT-OSS train to the same loss in every layout that runs it, as a user checks it: one
`experiment=loss_parity` run per model (a seed checkpoint, then each layout from it), its layouts'
curves read back from MLflow; and the q/k norms' gradients under tensor parallelism, on real gloo
ranks, against one device's."""

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from launchers.rendezvous import free_port
from titan_exp.config.compose import compose_job_config
from titan_exp.job.parity import layout_folder
from titan_exp.metrics.expert_load import EXPERT_LOAD_ARTIFACT
from titan_exp.models.registry import build_model
from titan_exp.parallel.tensor_parallel import apply_tensor_parallel
from titan_exp.tracking.journal import RUN_ID_FILE

from conftest import loss_curve, mlflow_client, mlflow_runs, run_cli

STEPS = 6
LOAD = "moe/load_imbalance"  # the worst MoE layer's routed tokens per expert, max over mean
RTOL = 1e-4
# Each layout takes the same 4 sequences a step (experiment=loss_parity's local batch is 4).
MOE_PRESET = compose_job_config(["experiment=loss_parity_moe"]).parity.layouts
REFERENCE = "parallelism=single"
FSDP_EP = "parallelism=fsdp launcher.nproc_per_node=2 training.local_batch_size=2 parallelism.expert_parallel_degree=2"
# By run: (model, experiment, layouts by name).
RUNS = {
    # Of experiment=loss_parity_moe's layouts, those whose every gradient tests/test_expert_parallel.py
    # does not hold against one device's in the default suite (pp2·ep2, cp2·ep2), and EP beside FSDP
    # and TP splitting the experts trained over the steps.
    "qwen3_moe_debug": (
        "qwen3_moe_debug",
        "loss_parity_moe",
        [
            REFERENCE,
            FSDP_EP,
            *(x for x in MOE_PRESET if "pipeline" in x or x.startswith("parallelism=cp")),
            "parallelism=tp launcher.nproc_per_node=2",
        ],
    ),  # fmt: skip
    # Latent attention, grouped sigmoid routing and a shared expert.
    "deepseek_v3_debug": (
        "deepseek_v3_debug",
        "loss_parity",
        [
            REFERENCE,
            FSDP_EP,
            "parallelism=pp launcher.nproc_per_node=2 parallelism.pipeline_parallel_schedule=1F1B",
            "parallelism=cp launcher.nproc_per_node=2 parallelism.expert_parallel_degree=2",
            # Latent attention split by heads, its latents whole on each rank.
            "parallelism=tp launcher.nproc_per_node=2 parallelism.expert_parallel_degree=2",
        ],
    ),
    # Attention sinks, alternating sliding windows, experts with biases and the clamped SwiGLU: of
    # experiment=loss_parity_gpt_oss's layouts, those that split what the family adds (the experts'
    # biases by expert; the heads' sinks, and w2's bias added once over TP's split of the experts;
    # the layers by stage).
    "gpt_oss_debug": (
        "gpt_oss_debug",
        "loss_parity_gpt_oss",
        [
            REFERENCE,
            FSDP_EP,
            "parallelism=tp launcher.nproc_per_node=2",
            "parallelism=pp launcher.nproc_per_node=2 parallelism.pipeline_parallel_schedule=1F1B",
        ],
    ),
}
# Beyond the default suite (which stays under 10 minutes on 2 cores), every run: each takes 40-70 s
# of real training. What the default suite holds instead: every parameter's gradient against one
# device's under fsdp4·ep2, tp2·ep2, fsdp2·tp2·ep2·etp2 and DeepSeek-V3's tp2·ep2
# (tests/test_expert_parallel.py), the dense Qwen3's q/k norms' gradients under TP (below), and
# tensor parallel training to the same loss (tests/test_parity.py).
SLOW = tuple(RUNS)


def parity_curves(run: str, folder: Path) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each layout's loss curve and expert load, by layout, from one loss-parity run."""
    db = folder / "mlflow.db"
    model, experiment, layouts = RUNS[run]
    result = run_cli(
        [
            f"experiment={experiment}",
            f"model={model}",
            f"training.steps={STEPS}",
            "parity.layouts=[" + ",".join(f"'{layout}'" for layout in layouts) + "]",
            f"tracking.uri=sqlite:///{db}",
        ],
        folder,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [parent] = mlflow_runs(db, sweeps=True)
    assert parent.info.run_name == experiment  # loss_parity_moe's, named so
    client = mlflow_client(db)
    run_ids = {layout: (folder / "run" / layout_folder(layout) / RUN_ID_FILE).read_text().strip() for layout in layouts}
    assert {client.get_run(run_id).data.tags["model"] for run_id in run_ids.values()} == {model}
    load = {name: [m.value for m in client.get_metric_history(run_id, LOAD)] for name, run_id in run_ids.items()}
    for run_id in run_ids.values():  # each run's load picture
        assert EXPERT_LOAD_ARTIFACT in {a.path for a in client.list_artifacts(run_id)}
    return {name: loss_curve(db, run_id) for name, run_id in run_ids.items()}, load


@pytest.mark.parametrize("run", [pytest.param(r, marks=pytest.mark.slow) if r in SLOW else r for r in RUNS])
def test_every_layout_reproduces_the_single_device_curve(run, tmp_path):
    curves, load = parity_curves(run, tmp_path)
    reference = curves.pop(REFERENCE)
    assert len(reference) == STEPS and reference[-1] < reference[0], reference  # it trains
    for name, curve in curves.items():
        assert curve == pytest.approx(reference, rel=RTOL), name
    # The experts' load, a count of the routing, is the same in every layout.
    assert all(len(curve) == STEPS for curve in load.values()), load
    assert all(curve == load[REFERENCE] for curve in load.values()), load


def _tensor_parallel_grads(rank: int, port: int, results: dict) -> None:
    """Rank `rank` of 2: the q/k norms' gradients of one backward under TP, gathered whole."""
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = one_layer_qwen3()
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        logits = model(TOKENS).full_tensor()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), TOKENS.flatten()).backward()
        attention = model.layers["0"].attention
        results[rank] = {name: getattr(attention, name).weight.grad.full_tensor() for name in ("q_norm", "k_norm")}
    finally:
        dist.destroy_process_group()


TOKENS = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))


def one_layer_qwen3() -> torch.nn.Module:
    cfg = dataclasses.replace(compose_job_config(["model=qwen3_debug"]).model, n_layers=1)
    model = build_model(cfg)
    model.init_weights(seed=0)
    for norm in (model.layers["0"].attention.q_norm, model.layers["0"].attention.k_norm):
        torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1, generator=torch.Generator().manual_seed(1))
    return model


def test_qk_norm_gradients_under_tensor_parallel_are_the_whole_models():
    """Each TP rank holds half the heads: the norms' weight gradient is the sum over both halves,
    the single-device gradient, on every rank (a weight taken as replicated with its input would
    get only its own heads' half, and the ranks' weights would drift apart)."""
    single = one_layer_qwen3()
    logits = single(TOKENS)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), TOKENS.flatten()).backward()
    results = mp.Manager().dict()
    mp.spawn(_tensor_parallel_grads, args=(free_port(), results), nprocs=2)
    for rank in range(2):
        for name in ("q_norm", "k_norm"):
            expected = getattr(single.layers["0"].attention, name).weight.grad
            torch.testing.assert_close(results[rank][name], expected, rtol=1e-4, atol=1e-6, msg=f"{name} rank {rank}")

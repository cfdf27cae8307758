"""Expert parallelism on real gloo ranks: one forward and backward of the MoE debug models in each
expert-parallel layout (DeepSeek-V3's latent attention split by TP too) gives every parameter the
single-device gradient (gathered whole), and the
same gradient norm: a wrong divide factor on the experts' gradients, or a norm that misses a mesh,
shows here, where Adam's scale-free first steps would hide it from a loss curve. The model's
auxiliary loss is on (Qwen3's, over the global batch): 3% of the router's gradient, so a rank
that counted its own tokens only, or TP's slices twice, fails too."""

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import loss_parallel

from launchers.rendezvous import free_port
from titan_exp.config.compose import compose_job_config
from titan_exp.models.common.transformer import canonical_name
from titan_exp.models.registry import build_model
from titan_exp.optim.grad_clip import clip_grad_norm_, reduce_partial_gradients
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.train.model_parts import build_model_parts

from conftest import mlflow_client, mlflow_runs, run_cli

QWEN3 = ("model=qwen3_moe_debug",)
# Latent attention with a query latent, and without one (wq whole, split by heads under TP).
DEEPSEEK = ("model=deepseek_v3_debug",)
DEEPSEEK_NO_Q_LATENT = ("model=deepseek_v3_debug", "model.mla.q_lora_rank=0")
MODEL = [*QWEN3, "training.mixed_precision_param=float32"]  # the profiled run's
TOKENS = torch.randint(0, 2048, (4, 32), generator=torch.Generator().manual_seed(0))
# name: (model, world size, layout)
LAYOUTS = {
    "ep2": (QWEN3, 2, ["parallelism=fsdp", "parallelism.expert_parallel_degree=2"]),
    "fsdp4·ep2": (QWEN3, 4, ["parallelism=fsdp", "parallelism.expert_parallel_degree=2"]),
    "fsdp2·ep4": (QWEN3, 4, ["parallelism=fsdp", "parallelism.expert_parallel_degree=4"]),
    "tp2·ep2": (QWEN3, 2, ["parallelism=tp", "parallelism.expert_parallel_degree=2"]),
    # The experts' shards replicated like the dense ones' (their gradients all-reduced over replicas).
    "hsdp2x2·ep2": (QWEN3, 4, ["parallelism=hsdp", "parallelism.expert_parallel_degree=2"]),
    # DDP's replicas: the experts split over the tp ranks, replicated with the dense weights.
    "ddp2·tp2·ep2": (
        QWEN3,
        4,
        ["parallelism=ddp", "parallelism.tensor_parallel_degree=2", "parallelism.expert_parallel_degree=2"],
    ),
    "deepseek·tp2·ep2": (DEEPSEEK, 2, ["parallelism=tp", "parallelism.expert_parallel_degree=2"]),
    # TP splitting the experts' hidden dim (expert_tensor_parallel_degree = tp, and TP without EP):
    # the sequence slices' tokens gathered, the partial outputs reduce-scattered; DeepSeek-V3's
    # shared experts split like a dense FFN.
    "tp2": (QWEN3, 2, ["parallelism=tp"]),
    "fsdp2·tp2·ep2·etp2": (
        QWEN3,
        4,
        [
            "parallelism=fsdp_tp",
            "parallelism.expert_parallel_degree=2",
            "parallelism.expert_tensor_parallel_degree=2",
        ],
    ),
    # ... with the experts' 2D shards FSDP-sharded over the 2 data-parallel ranks EP leaves.
    "fsdp4·tp2·ep2·etp2": (
        QWEN3,
        8,
        [
            "parallelism=fsdp_tp",
            "parallelism.expert_parallel_degree=2",
            "parallelism.expert_tensor_parallel_degree=2",
        ],
    ),
    "deepseek·tp2": (DEEPSEEK, 2, ["parallelism=tp"]),
    "deepseek·no_q_latent·tp2·ep2": (
        DEEPSEEK_NO_Q_LATENT,
        2,
        ["parallelism=tp", "parallelism.expert_parallel_degree=2"],
    ),
}


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _grads(rank: int, world: int, port: int, layouts: dict[str, list[str]], results: dict) -> None:
    """One world of `world` ranks runs each of `layouts` in turn (a mesh and model of its own each):
    rank 0 puts each layout's gradients, norm and experts' placement in `results`."""
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name, overrides in layouts.items():
            try:
                found = _layout_grads(world, overrides)
            except Exception as err:
                err.add_note(f"in layout {name}")  # the others of this world end with it
                raise
            if rank == 0:
                results[name] = found
    finally:
        dist.destroy_process_group()


def _layout_grads(world: int, overrides: list[str]) -> dict:
    cfg = compose_job_config([*overrides, "training.mixed_precision_param=float32"])
    mesh = ParallelMesh(ParallelDims.resolve(cfg.parallelism, world), "cpu")
    model = build_model_parts(cfg, mesh, torch.device("cpu")).parts[0]
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    rows = TOKENS.chunk(mesh.dims.dp)[mesh.dp_rank]  # this rank's sequences
    if mesh.dims.tp > 1:
        with loss_parallel():
            loss = _loss(model(rows), rows)
            loss.backward()
    else:
        _loss(model(rows), rows).backward()
    reduce_partial_gradients(list(model.parameters()))  # as the trainer does, once, before the norm
    assert not [p for p in model.parameters() if isinstance(p.grad, DTensor) and Partial() in p.grad.placements]
    norm = clip_grad_norm_(list(model.parameters()), max_norm=0.0)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grads[canonical_name(name)] = grad.clone()
    w1 = model.layers["3"].moe.experts.w1  # how the experts' weights are split
    placements = dict(zip(w1.device_mesh.mesh_dim_names, map(str, w1.placements)))
    return {"grads": grads, "norm": norm.item(), "w1": placements}


def _single_device(model_overrides: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], float]:
    model = build_model(compose_job_config(list(model_overrides)).model)
    model.init_weights(seed=0)
    _loss(model(TOKENS), TOKENS).backward()
    norm = clip_grad_norm_(list(model.parameters()), max_norm=0.0)
    return {name: param.grad for name, param in model.named_parameters()}, norm.item()


@pytest.fixture(scope="module")
def single_device():
    """One device's gradients and norm, by model (each computed once)."""
    return functools.cache(_single_device)


# Beyond the default suite: EP over all four ranks, the query without a latent (one plain colwise
# linear), and eight ranks.
SLOW = ("fsdp2·ep4", "deepseek·no_q_latent·tp2·ep2", "fsdp4·tp2·ep2·etp2")


def _world_of(layout: str) -> tuple[int, bool]:
    """The layouts that run in one world of rank processes: those of one world size, in the
    default suite or beyond it."""
    return LAYOUTS[layout][1], layout in SLOW


@pytest.fixture(scope="module")
def distributed():
    """Each layout's results from the rank processes: a world's rank processes (their start-up
    takes longer than any layout's step) run every layout of their size, made once, when the first
    of them is asked for."""
    found = {}

    def results(layout: str) -> dict:
        if layout not in found:
            world = LAYOUTS[layout][1]
            layouts = {name: [*model, *overrides] for name, (model, _, overrides) in LAYOUTS.items()}
            together = {name: layouts[name] for name in LAYOUTS if _world_of(name) == _world_of(layout)}
            shared = mp.Manager().dict()
            mp.spawn(_grads, args=(world, free_port(), together, shared), nprocs=world)
            found.update(shared)
        return found[layout]

    return results


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in LAYOUTS]
)
def test_every_parameter_gets_the_single_device_gradient(layout, single_device, distributed):
    model, world, overrides = LAYOUTS[layout]
    expected, expected_norm = single_device(model)
    results = distributed(layout)
    grads = results["grads"]
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-7, msg=f"{layout}: {name}")
    assert results["norm"] == pytest.approx(expected_norm, rel=1e-4)  # the loss-parity tolerance
    dims = ParallelDims.resolve(compose_job_config([*model, *overrides]).parallelism, world)
    # TP splits each expert's hidden dim (w1: experts × hidden × dim) where it splits the experts.
    assert (results["w1"].get("tp") == "S(1)") == (dims.experts_tp > 1)


def test_a_profiled_expert_parallel_run_reports_its_all_to_all_time(tmp_path, store):
    """With profiling on, the exchanges' time per recorded step (the profiler's moe/all_to_all
    ranges, forward and backward) is a metric of the run, beside the load and auxiliary loss."""
    uri, db = store
    result = run_cli(
        [
            *MODEL,
            uri,
            "parallelism=fsdp",
            "launcher.nproc_per_node=2",
            "training.local_batch_size=2",
            "parallelism.expert_parallel_degree=2",
            "training.steps=4",
            "profiling.enable_profiling=true",
            "profiling.profile_freq=2",
            "profiling.profiler_warmup=0",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = mlflow_runs(db)
    history = mlflow_client(db).get_metric_history(run.info.run_id, "moe/all_to_all_ms_per_step")
    assert [m.step for m in history] == [2, 4] and all(m.value > 0 for m in history)
    assert run.data.metrics["moe/aux_loss"] > 0 and run.data.metrics["moe/load_imbalance"] >= 1

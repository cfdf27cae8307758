"""What the planner measures on this machine (imports torch; the planner's command loads it, the
pre-flight check does not):

- the `cpu` device profile: matmul peak at a rank's thread count, memory bandwidth, gloo's
  per-call cost and bandwidth between two rank processes; cached under outputs/cache;
- a rank's compute at its real shapes: one transformer layer of the model, built as training
  builds it (train/model_parts.py: float8 conversion, TP's code path, activation checkpointing),
  forward and backward on the rank's tokens, the output head and loss, and the training step's
  optimizer update, timed here (on CPU ranks this *is* the device).
"""

import contextlib
import dataclasses
import functools
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from launchers.devices import available_memory
from launchers.rendezvous import free_port
from titan_exp.config.job import ResolvedJob, changed_config
from titan_exp.config.schema import JobConfig
from titan_exp.estimate.config import HardwareConfig
from titan_exp.estimate.memory import RankMemory
from titan_exp.estimate.step_time import ComputeTimes
from titan_exp.estimate.workload import DTYPE_BYTES, pipeline_chunks_in_flight, whole_under_tensor_parallel
from titan_exp.metrics.peak_flops import cached, cpu_name, cpu_peak_flops, raise_cpu_peak
from titan_exp.optim.optimizer import Optimizers
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.parallel.stages import StagePlan
from titan_exp.train.loss import cross_entropy_loss
from titan_exp.train.model_parts import build_model_parts, materialize
from titan_exp.units import GIB

_GLOO_SIZES = (1024, 2 * 1024**2, 8 * 1024**2, 32 * 1024**2)


def median_seconds(fn, repeats: int = 3) -> float:
    """Median seconds of `fn` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_gbps() -> float:
    """What a 128 MiB float32 copy reads plus writes per second (GB/s)."""
    source, target = torch.empty(32 * 1024**2), torch.empty(32 * 1024**2)
    return 2 * source.numel() * 4 / median_seconds(lambda: target.copy_(source)) / 1e9


def _gloo_rank(rank: int, port: int, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        seconds = {}
        for size in _GLOO_SIZES:
            local, whole = torch.ones(size // 4), torch.ones(2 * size // 4)
            dist.barrier()
            gather = median_seconds(lambda w=whole, t=local: dist.all_gather_single(w, t), repeats=7)
            scatter = median_seconds(lambda w=whole, t=local: dist.reduce_scatter_single(t, w), repeats=7)
            seconds[size] = (gather, scatter)
        out[rank] = seconds
    finally:
        dist.destroy_process_group()


def _gloo_link() -> dict[str, float]:
    """Between two rank processes (medians of 7 calls): the per-call cost of a tiny all-gather and
    of a tiny reduce-scatter (gloo's is higher), and the bus bandwidth of all-gathers from 2 to 32 MB
    (the sizes of FSDP's units and TP's activations), their median."""
    port = free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        # spawn, not fork: a fork of a process whose OpenMP threads have run can hang.
        mp.start_processes(_gloo_rank, args=(port, out), nprocs=2, start_method="spawn")
        seconds = dict(out[0])
    gather, scatter = seconds[_GLOO_SIZES[0]]
    # Each rank sends its `size` bytes, the half of the gathered 2·size the other rank lacks
    # ((g-1)/g of the buffer: the traffic estimate/collectives.py prices).
    rates = [size / max(seconds[size][0] - gather, 1e-9) / 1e9 for size in _GLOO_SIZES[1:]]
    return {
        "collective_latency_us": gather * 1e6,
        "reduce_latency_us": scatter * 1e6,
        "intra_node_gbps": statistics.median(rates),
    }


def cpu_profile(threads: int, cache_dir: str) -> dict[str, float]:
    """This machine's figures for a rank with `threads` threads (gloo's between two single-thread
    ranks), measured once and cached under cache_dir."""
    path = Path(cache_dir) / "cpu_profile.json"
    # "gloo link": figures cached under "gloo" counted half of each rank's send; measured again.
    link = cached(path, f"{cpu_name()}|gloo link", _gloo_link)

    def measure() -> dict[str, float]:
        with _threads(threads):
            return {
                "peak_tflops_float32": cpu_peak_flops(torch.float32, cache_dir) / 1e12,
                "peak_tflops_bfloat16": cpu_peak_flops(torch.bfloat16, cache_dir) / 1e12,
                "memory_gbps": copy_gbps(),
            }

    return cached(path, f"{cpu_name()}|threads={threads}", measure) | link


def resolve_hardware(hw: HardwareConfig, threads: int, cache_dir: str) -> HardwareConfig:
    """`hw` with every -1 measured here (the `cpu` profile)."""
    if all(value != -1 for value in dataclasses.asdict(hw).values()):
        return hw
    found = cpu_profile(threads, cache_dir)
    found["peak_tflops_float8"] = found["peak_tflops_bfloat16"]  # emulated: no float8 units on a CPU
    found["inter_node_gbps"] = found["intra_node_gbps"]
    found["memory_gib"] = (available_memory() or 0) / GIB
    # Compute is timed on CPU ranks, not modelled op by op: the kernels' figures are not used.
    found |= dict.fromkeys(("matmul_efficiency", "float8_matmul_efficiency", "attention_efficiency"), 1.0)
    found |= {"memory_efficiency": 1.0, "sm_count": 1}
    return dataclasses.replace(hw, **{k: v for k, v in found.items() if getattr(hw, k) == -1})


def measured_compute(
    cfg: JobConfig, tokens: tuple[int, int], dims: ParallelDims, local_params: float, threads: int
) -> tuple[ComputeTimes, float]:
    """Times one layer (forward + backward, recomputation included), the output head with the loss,
    and the optimizer step over `local_params` parameters, for a microbatch of `tokens` = (samples,
    sequence length on this rank), on this machine with `threads` threads; the matmuls' share
    divided by tp, whose shards split them. Under tensor parallelism a layer also pays DTensor's
    dispatch: measured as the layer over a one-rank tp mesh (no communication; the MoE layer's
    path as `dims` splits its experts) against the plain one. With the share of its threads' time
    the timing got (_CpuShare)."""
    tp = dims.tp
    with _threads(threads), _CpuShare(threads) as got:
        layer, head, optimizer = _timed_parts(cfg, tokens, local_params, tensor_parallel=False)
        if tp > 1:
            with _one_rank_world():
                tp_layer, tp_head, _ = _timed_parts(
                    cfg, tokens, local_params, tensor_parallel=True, experts_split=dims.experts_tp > 1
                )
    if tp == 1:
        return ComputeTimes(layer=layer, head=head, optimizer=optimizer), got.share
    # What TP splits runs 1/tp as long; latent attention's down-projections run whole on every rank.
    whole = whole_under_tensor_parallel(cfg.model, cfg.training.seq_len)
    times = ComputeTimes(
        layer=layer * (whole + (1 - whole) / tp) + max(0.0, tp_layer - layer),
        head=head / tp + max(0.0, tp_head - head),
        optimizer=optimizer,
    )
    return times, got.share


class _CpuShare:
    """The share of its threads' wall time this process got while inside: well below 1, other
    processes took the cores and what was timed runs slower than on this machine alone (plan/cli.py's
    busy_caution says so)."""

    def __init__(self, threads: int):
        self.threads, self.share = threads, 1.0

    def __enter__(self) -> "_CpuShare":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        wall = max((time.perf_counter() - self.wall) * self.threads, 1e-9)
        self.share = (time.process_time() - self.cpu) / wall


def raised_peak(hw: HardwareConfig, dtype: str, threads: int, cache_dir: str, beaten_by: float) -> HardwareConfig:
    """`hw` with the CPU's peak for `dtype` measured again, at least `beaten_by` (FLOP/s a timing
    reached): the cached one was measured on a busy machine (metrics/peak_flops.py)."""
    with _threads(threads):
        peak = raise_cpu_peak(getattr(torch, dtype), cache_dir, beaten_by)
    return dataclasses.replace(hw, **{f"peak_tflops_{dtype}": peak / 1e12})


@contextlib.contextmanager
def _threads(count: int):
    """torch's intra-op threads set to `count` for a measurement (a rank's share), then restored."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def _one_rank_world():
    """This process as the only rank of a gloo group (for DTensor over a one-rank mesh)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


_ONE_RANK = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1)


class _OneRankTensorParallel(ParallelMesh):
    """This process as a tp rank whose only peer is itself: the layout's TP code path (DTensor's
    dispatch; where TP splits the experts, their gather and reduce) with no communication."""

    def __init__(self, experts_split: bool):
        super().__init__(_ONE_RANK, "cpu")
        self._tp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        self._experts_split = experts_split

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self._tp_mesh

    @property
    def experts_split_by_tp(self) -> bool:
        return self._experts_split


def _timed_parts(
    cfg: JobConfig, tokens: tuple[int, int], local_params: float, tensor_parallel: bool, experts_split: bool = False
) -> tuple[float, float, float]:
    """Seconds of (one layer's forward + backward, the head's with the loss, the optimizer step) of
    a model of one or two layers built as training builds it; a model with dense layers before its
    MoE ones times one of each, and a layer's seconds are their mean over the model's
    layers."""
    m = cfg.model
    dense = m.n_layers - m.num_moe_layers
    mixed = 0 < dense < m.n_layers  # a MoE model with dense layers first
    # Layer 0 as the model's first; where the model mixes kinds, layer 1 a MoE one.
    shares = {0: dense / m.n_layers, 1: m.num_moe_layers / m.n_layers} if mixed else {0: 1.0}
    moe = dataclasses.replace(m.moe, n_dense_layers=1) if mixed else m.moe
    # Eager: compiling a block here would cost more than the plan it informs.
    small = changed_config(
        cfg,
        model={"n_layers": len(shares), "moe": moe, "max_seq_len": max(m.max_seq_len, tokens[1])},
        compile={"enable": False},
        checkpoint={"initial_load_path": None, "initial_load_in_hf": False},
    )
    mesh = _OneRankTensorParallel(experts_split) if tensor_parallel else ParallelMesh(_ONE_RANK, "cpu")
    parts = build_model_parts(small, mesh, torch.device("cpu"))
    materialize(parts, small, torch.device("cpu"))
    [model] = parts.parts
    # The weights in the compute dtype, as FSDP's mixed precision gathers them.
    dtype = getattr(torch, cfg.training.mixed_precision_param)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    inputs = torch.randint(m.vocab_size, tokens)
    hidden = torch.randn(*tokens, m.dim, dtype=dtype, requires_grad=True)
    freqs = model.freqs_cis[: tokens[1]]

    def head_step() -> None:
        with loss_parallel() if tensor_parallel else contextlib.nullcontext():
            cross_entropy_loss(model.output(model.norm(hidden)), inputs).backward()

    optimizer_seconds = 0.0
    if not tensor_parallel:  # the step over local shards: the same with or without DTensor
        optimizers = Optimizers.build(parts.parts, small.optimizer, small.lr_scheduler, small.training.steps)
        params = parts.parameters
        grads = [torch.zeros_like(param) for param in params]

        def update() -> None:
            for param, grad in zip(params, grads):
                param.grad = grad
            optimizers.step()

        optimizer_seconds = median_seconds(update) * local_params / model.num_params()

    def layer_step(index: int) -> None:
        model.layers[str(index)](hidden, freqs).sum().backward()

    # The median of seven: a run's steady steps are typical passes, not its fastest (on this
    # machine the same pass's times spread by ~25% between the fastest and the median, in one
    # process alone and in two side by side, so the fastest would predict steps ~20% short).
    layer_seconds = sum(
        share * median_seconds(functools.partial(layer_step, index), repeats=7) for index, share in shares.items()
    )
    return layer_seconds, median_seconds(head_step, repeats=7), optimizer_seconds


# The dry run's categories (MemTracker's, at rank 0's peak) as the memory model's, and which of
# them grow with the layers a rank holds (FSDP's gathered units and the temporaries of one layer's
# backward do not: one or two units are gathered at a time). Unsharded gradients are counted apart:
# accumulated under training.gradient_sync=last_microbatch, every unit keeps its own.
_CATEGORIES = (
    ("parameters", ("sharded_param", "parameter"), True),
    # The rotary table, whatever the layers (the MoE layers' load counters are a few bytes).
    ("buffers", ("buffer",), False),
    ("gradients", ("sharded_grad", "gradient"), True),
    ("activations", ("activation",), True),
    ("temporaries", ("temp",), False),
    ("communication", ("unsharded_param",), False),
    ("communication", ("unsharded_grad",), False),
)


def fake_pass_memory(job: ResolvedJob) -> RankMemory:
    """Rank 0's active peak by category, measured by the dry run's pass (MemTracker over a step's
    forwards and backwards under the fake process group and FakeTensorMode, train/dry_run.py) on the layout
    with one and with two layers per pipeline stage, extrapolated to the model's layers where a
    category grows with them. The planner's cross-check of the memory model: the pass runs eager
    (Dynamo cannot trace under MemTracker; compile's savings are the model's alone), and under
    pipelining one stage at a time, its activations times the stage-microbatches the schedule keeps
    in flight (estimate/memory.py)."""
    from titan_exp.train.dry_run import fake_backend_dry_run

    cfg = job.config
    p = cfg.parallelism
    plan = StagePlan.from_config(p, cfg.model.n_layers)
    layers_here = len(plan.layers(0, cfg.model.n_layers))
    reports = []
    for per_stage in (1, 2):
        stages = {"pipeline_parallel_layers_per_stage": per_stage} if p.pipeline_parallel_layers_per_stage else {}
        layers = {"n_layers": per_stage * plan.num_stages}
        small = job.replaced(model=layers, parallelism=stages, compile={"enable": False})
        reports.append(fake_backend_dry_run(small))

    def category(report: dict, names: tuple[str, ...]) -> float:
        return sum(report.get(f"rank0_step_peak_{name}_gib", 0.0) for name in names) * GIB

    grows_always = p.fsdp_reshard_after_forward == "never"
    # Accumulating under training.gradient_sync=last_microbatch, FSDP keeps every unit's unsharded
    # gradient, which MemTracker counts as unsharded gradients or (under checkpointing) temporaries.
    accumulating = job.dims.fsdp_enabled and job.accumulation > 1 and cfg.training.gradient_sync == "last_microbatch"
    found: dict[str, float] = {}
    for name, names, grows in _CATEGORIES:
        grows = grows or grows_always or (accumulating and names in (("temp",), ("unsharded_grad",)))
        one, two = category(reports[0], names), category(reports[1], names)
        found[name] = found.get(name, 0.0) + (max(0.0, one + (layers_here - 1) * (two - one)) if grows else two)
    one, two = (r["rank0_optimizer_state_gib"] * GIB for r in reports)
    found["optimizer_state"] = one + (layers_here - 1) * (two - one)
    if p.pipeline_parallel_degree > 1:
        microbatches = cfg.training.local_batch_size // p.pipeline_parallel_microbatch_size
        found["activations"] *= pipeline_chunks_in_flight(p, microbatches)
        # A microbatch's backward runs before the last one's forward: the stage's gradients exist
        # at the peak, under FSDP unreduced (torch's PipelineStage syncs them after the last one).
        shard = p.data_parallel_shard_degree * p.context_parallel_degree
        param_bytes = DTYPE_BYTES[cfg.training.mixed_precision_param]
        found["gradients"] = found["parameters"] * (shard * param_bytes / 4 if shard > 1 else 1)
    return RankMemory(
        **{name: int(size) for name, size in found.items()},
        logits=0, allocator=0, process=0, phase="fake pass (eager)",
    )  # fmt: skip

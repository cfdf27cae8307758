"""`titan_exp plan probe --hardware NAME [overrides]`: this machine's kernel rates measured as
tables (estimate/kernel_tables.py) for the shapes of the job the overrides describe, written as a
device profile of its own that `plan` and `hardware=NAME` take, and logged to MLflow as a run.

What it measures, each a median of timed calls after a warm-up:
- GEMMs in the job's matmul dtype: every shape a block's linears and the output head run for
  the job's microbatch on one rank (forward, and backward's two: estimate/gpu_compute.py's
  `_linear`), and a grid of square and thin shapes around them for what the plan asks beyond;
- collectives between two rank processes over gloo (all-gather, reduce-scatter, all-reduce,
  all-to-all, a send and its receive), 4 KiB to 32 MiB;
- a large copy's read-plus-write bandwidth, and one eager op's host cost.

Here that is CPU cores (a rank's threads) and gloo in one node, on the machine the command runs
on. Placing the probe on other nodes through a launcher (Slurm, Ray) and timing CUDA kernels and
NCCL across nodes is not built yet: `plan probe` refuses a GPU profile.
"""

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from launchers.rendezvous import free_port
from titan_exp.config.job import ResolvedJob
from titan_exp.config.schema import register_schema
from titan_exp.estimate.config import HardwareConfig
from titan_exp.estimate.gpu_compute import linear_shapes
from titan_exp.estimate.kernel_tables import CollectivePoint, GemmPoint, KernelTables
from titan_exp.estimate.user_profiles import NAME_RULE, is_profile_name, profiles_folder
from titan_exp.job.memory import workload
from titan_exp.plan.measure import copy_gbps, median_seconds
from titan_exp.plan.point import compose_point, cpu_ranks
from titan_exp.rules import ConfigError
from titan_exp.units import GIB

_SIZES = (4 << 10, 256 << 10, 2 << 20, 8 << 20, 32 << 20)
_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
# Square and thin shapes around the job's (powers of two): where the plan's other shapes fall between.
_GRID = (64, 256, 1024, 4096)


class Refused(Exception):
    """A probe that cannot run as asked: one line, exit 2."""


def job_gemm_shapes(job: ResolvedJob) -> set[tuple[int, int, int]]:
    """(m, n, k) of every GEMM a block's linears and the output head run on one rank for one microbatch."""
    w = workload(job.config, "cpu")
    tokens = int(w.tokens)
    shapes = set()
    head = (w.model.dim, w.model.vocab_size / w.parallelism.tensor_parallel_degree)
    linears = [*linear_shapes(w).values(), head]
    for fan_in, fan_out in linears:
        fan_in, fan_out = int(fan_in), int(fan_out)
        shapes |= {(tokens, fan_out, fan_in), (tokens, fan_in, fan_out), (fan_in, fan_out, tokens)}
    return shapes


def grid_shapes() -> set[tuple[int, int, int]]:
    return {(m, n, k) for m in _GRID for n in _GRID for k in _GRID if max(m, n, k) <= 16 * min(m, n, k)}


def measure_gemms(shapes: set[tuple[int, int, int]], dtype: str) -> list[GemmPoint]:
    torch_dtype = getattr(torch, dtype)
    points = []
    for m, n, k in sorted(shapes):
        a, b = torch.randn(m, k, dtype=torch_dtype), torch.randn(k, n, dtype=torch_dtype)
        out = torch.empty(m, n, dtype=torch_dtype)
        repeats = 3 if 2 * m * n * k > 2e10 else 7
        seconds = median_seconds(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), repeats)
        points.append(GemmPoint(m, n, k, dtype, 2 * m * n * k / max(seconds, 1e-9) / 1e12))
    return points


def _collective(op: str, size: int) -> tuple:
    """The call timing `op` on `size` bytes (the convention of estimate/collectives.py) on two ranks."""
    half = size // 4 // 2
    rank = dist.get_rank()
    if op == "all_gather":
        whole, local = torch.ones(2 * half), torch.ones(half)
        return lambda: dist.all_gather_single(whole, local)
    if op == "reduce_scatter":
        whole, local = torch.ones(2 * half), torch.ones(half)
        return lambda: dist.reduce_scatter_single(local, whole)
    if op == "all_reduce":
        buffer = torch.ones(size // 4)
        return lambda: dist.all_reduce(buffer)
    if op == "all_to_all":
        send, receive = torch.ones(size // 4), torch.empty(size // 4)
        return lambda: dist.all_to_all_single(receive, send)
    buffer, peer = torch.ones(size // 4), 1 - rank  # send_recv: rank 0 sends, rank 1 receives

    def send_recv() -> None:
        (dist.send if rank == 0 else dist.recv)(buffer, peer)

    return send_recv


def _collective_rank(rank: int, port: int, out: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        found = []
        for op in _COLLECTIVES:
            for size in _SIZES:
                call = _collective(op, size)
                dist.barrier()
                found.append((op, size, median_seconds(call, repeats=7)))
        out[rank] = found
    finally:
        dist.destroy_process_group()


def measure_collectives() -> list[CollectivePoint]:
    """Two rank processes on this machine over gloo; the slower rank's median per call."""
    port = free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        # spawn, not fork: a fork of a process whose OpenMP threads have run can hang.
        mp.start_processes(_collective_rank, args=(port, out), nprocs=2, start_method="spawn")
        ranks = [list(out[0]), list(out[1])]
    return [
        CollectivePoint(op, float(size), 2, False, max(seconds, other))
        for (op, size, seconds), (*_, other) in zip(*ranks)
    ]


def measure_op_overhead_us() -> float:
    a, b = torch.ones(1), torch.ones(1)
    return median_seconds(lambda: [torch.add(a, b) for _ in range(1000)]) / 1000 * 1e6


def probe(job: ResolvedJob, name: str) -> tuple[KernelTables, dict]:
    """The tables measured for `job`'s shapes, and the profile's figures that go with them."""
    threads, _ = cpu_ranks(job)
    dtype = job.config.training.mixed_precision_param
    dtype = "bfloat16" if dtype == "float16" else dtype
    torch.set_num_threads(threads)
    gemm = measure_gemms(job_gemm_shapes(job), dtype) + measure_gemms(grid_shapes(), dtype)
    if dtype != "float32":  # the optimizer's and the loss's float32 work, the grid only
        gemm += measure_gemms(grid_shapes(), "float32")
    copied_gbps, overhead = copy_gbps(), measure_op_overhead_us()
    collectives = measure_collectives()
    when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    tables = KernelTables(
        source=f"titan_exp plan probe on {platform.node()} ({_cpu_model()}), {threads} thread(s) a rank, {when}",
        provenance="measured",
        gemm=tuple(gemm),
        collectives=tuple(collectives),
        elementwise_gbps=copied_gbps,
        op_overhead_us=overhead,
        notes=[f"shapes of: {job.model_name}, microbatch {job.config.training.local_batch_size} x seq "
               f"{job.config.training.seq_len}, {job.dims.label()}"],
    )  # fmt: skip
    best = {d: max((p.tflops for p in gemm if p.dtype == d), default=None) for d in ("float32", "bfloat16")}
    small = min((p for p in collectives if p.op == "all_gather"), key=lambda p: p.bytes)
    small_reduce = min((p for p in collectives if p.op == "reduce_scatter"), key=lambda p: p.bytes)
    large = max((p for p in collectives if p.op == "all_gather"), key=lambda p: p.bytes)
    link_gbps = large.bytes / 2 / max(large.seconds - small.seconds, 1e-9) / 1e9
    figures = {
        "peak_tflops_float32": best["float32"],
        "peak_tflops_bfloat16": best["bfloat16"] or best["float32"],
        "peak_tflops_float8": best["bfloat16"] or best["float32"],
        "memory_gbps": copied_gbps,
        "collective_latency_us": small.seconds * 1e6,
        "reduce_latency_us": small_reduce.seconds * 1e6,
        "intra_node_gbps": link_gbps,
        "inter_node_gbps": link_gbps,
        "memory_gib": round(_available_gib(), 1),
        "matmul_efficiency": 1.0,
        "float8_matmul_efficiency": 1.0,
        "attention_efficiency": 1.0,
        "memory_efficiency": 1.0,
        "sm_count": 1,
    }
    return tables, figures


def _available_gib() -> float:
    from launchers.devices import available_memory

    return (available_memory() or 0) / GIB


def _cpu_model() -> str:
    from titan_exp.metrics.peak_flops import cpu_name

    return cpu_name()


def write_profile(base: HardwareConfig, name: str, tables: KernelTables, figures: dict, folder: Path) -> Path:
    """`<folder>/<name>.yaml`, the base profile with the measured figures and its table beside it
    (`<name>.kernels.json`), each written whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    table_file = tables_file(name)
    profile = dataclasses.asdict(base) | figures | {"name": name, "device_names": [], "kernel_tables": table_file}
    for file, text in ((table_file, tables.to_json()), (f"{name}.yaml", _header(tables) + yaml.safe_dump(profile))):
        partial = folder / f".{file}.partial"
        partial.write_text(text)
        partial.replace(folder / file)
    return folder / f"{name}.yaml"


def _header(tables: KernelTables) -> str:
    return f"# Measured by `titan_exp plan probe`: {tables.source}.\n# Kernel rates by shape: see kernel_tables.\n"


def _record(job: ResolvedJob, name: str, tables: KernelTables, profile: Path) -> str | None:
    """The probe as an MLflow run of its own (tagged role=probe): each GEMM's and collective's
    figure as a metric, the table and the profile as artifacts."""
    tracking = job.config.tracking
    if not tracking.enable:
        return None
    from titan_exp.tracking.run import ROLE_TAG, MlflowRun
    from titan_exp.tracking.store import ensure_store

    ensure_store(tracking)
    run = MlflowRun.create(tracking, f"probe: {name}", {ROLE_TAG: "probe", "hardware": name, "source": tables.source})
    metrics = {f"probe/gemm_tflops/{p.dtype}/{p.m}x{p.n}x{p.k}": p.tflops for p in tables.gemm}
    metrics |= {f"probe/{p.op}_seconds/{int(p.bytes)}B": p.seconds for p in tables.collectives}
    metrics |= {"probe/elementwise_gbps": tables.elementwise_gbps, "probe/op_overhead_us": tables.op_overhead_us}
    run.log_metrics([(0, metrics, int(time.time() * 1000))])
    for file in (profile, profile.parent / tables_file(name)):
        run.client.log_artifact(run.run_id, str(file), "probe")
    run.finish("FINISHED")
    return run.run_id


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="titan_exp plan probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", required=True, help="the probed profile's option name (hardware=NAME)")
    parser.add_argument("--out", type=Path, help="its folder (default: <user config folder>/hardware)")
    parser.add_argument("overrides", nargs="*", help="the job whose shapes to measure (model=..., training.*)")
    args = parser.parse_args(argv)
    register_schema()
    try:
        if not is_profile_name(args.hardware):
            raise Refused(f"--hardware={args.hardware!r}: a profile's name is {NAME_RULE}")
        from titan_exp.estimate.hardware_profiles import hardware_profiles

        if args.hardware in hardware_profiles():
            raise Refused(f"--hardware={args.hardware}: a profile shipped with titan_exp has that name; name yours")
        named = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("hardware=")), "cpu")
        shipped = hardware_profiles().get(named)
        if shipped is not None and shipped.device != "cpu":
            raise Refused(
                f"hardware={named}: probing a GPU's kernels (CUDA GEMMs, NCCL across nodes) is not built yet; "
                "probe this machine's CPU ranks (hardware=cpu)"
            )
        job = compose_point([*args.overrides, "launcher.device=cpu"])
    except (Refused, ConfigError) as err:
        print(f"titan_exp plan probe: {err}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    tables, figures = probe(job, args.hardware)
    profile = write_profile(job.config.hardware, args.hardware, tables, figures, args.out or profiles_folder())
    run_id = _record(job, args.hardware, tables, profile)
    print(f"probed in {time.perf_counter() - started:.0f} s: {len(tables.gemm)} GEMM shapes, "
          f"{len(tables.collectives)} collective points, copies at {tables.elementwise_gbps:.1f} GB/s")  # fmt: skip
    print(f"profile: {profile} (hardware={args.hardware}); table: {profile.parent / tables_file(args.hardware)}")
    if run_id:
        print(f"recorded in MLflow ({job.config.tracking.uri}): run {run_id}")
    return 0


def tables_file(name: str) -> str:
    return f"{name}.kernels.json"

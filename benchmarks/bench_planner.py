"""How well `python -m titan_exp plan` predicts real runs on this machine: for each layout, the
planner's peak memory per rank and step time against a real run's (memory: torch's MemTracker audit
of the last step on rank 0, tensor-level, not RSS; time: the median of the steady steps before it,
after the MLflow writer's start-up).
Prints a table, the memory error of each layout, the step time's mean absolute percentage error,
Kendall's τ between the predicted and measured TPS/device rankings, and one JSON object.

Layouts: the debug Llama (5.6M parameters) under single, ddp, fsdp, hsdp, tp, fsdp_tp, pp (1F1B and
Interleaved1F1B), 3D, full and selective activation checkpointing, float8; a larger Llama (33M
parameters: dim 512, 8 layers, vocab 8192) under fsdp, tp and pp; and qwen3_moe_debug under fsdp
and expert parallelism (ep2 beside fsdp2, fsdp4 and tp2), and TP splitting the experts (tp2
without EP, fsdp2·tp2·ep2·etp2); deepseek_v3_debug (latent attention, a shared expert) under
fsdp2·ep2 and tp2. Global batch 8 × seq 256, CPU
ranks (2 cores: 4- and 8-rank layouts share them).

With --repeats N each layout trains N times: the measured figures are the runs' medians, and the
spread of their step times (slowest over fastest, less 1) is this machine's own noise, the floor
under any step-time error.

Usage: python benchmarks/bench_planner.py [--only NAME ...] [--steps 16] [--repeats 1]
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench_vs_plain import REPO, env_with, stream

from titan_exp import metric_names as names
from titan_exp.config.schema import register_schema
from titan_exp.estimate.memory import rank_memory
from titan_exp.job.memory import workload
from titan_exp.plan.point import compose_point, plan_one
from titan_exp.units import GIB

COMMON = [
    "training.seq_len=256",
    "data=synthetic",
    "metrics.log_freq=1",
    "launcher.device=cpu",
    "launcher.oversubscribe=true",
]
LARGER = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4", "model.vocab_size=8192"]
FSDP2 = ["parallelism=fsdp", "launcher.nproc_per_node=2", "training.local_batch_size=4"]
FSDP4 = ["parallelism=fsdp", "launcher.nproc_per_node=4", "training.local_batch_size=2"]
MOE = ["model=qwen3_moe_debug"]
DEEPSEEK = ["model=deepseek_v3_debug"]
PP2 = ["parallelism=pp", "launcher.nproc_per_node=2", "training.local_batch_size=8"]
PP2 += ["parallelism.pipeline_parallel_microbatch_size=2"]
LAYOUTS = {
    "single": ["parallelism=single", "training.local_batch_size=8"],
    "ddp2": ["parallelism=ddp", "launcher.nproc_per_node=2", "training.local_batch_size=4"],
    "fsdp2": FSDP2,
    "hsdp2x2": ["parallelism=hsdp", "launcher.nproc_per_node=4", "training.local_batch_size=2"],
    "tp2": ["parallelism=tp", "launcher.nproc_per_node=2", "training.local_batch_size=8"],
    "fsdp2_tp2": ["parallelism=fsdp_tp", "launcher.nproc_per_node=4", "training.local_batch_size=4"],
    "pp2_1F1B": [*PP2, "parallelism.pipeline_parallel_schedule=1F1B"],
    "pp2_Interleaved1F1B": [*PP2, "parallelism.pipeline_parallel_schedule=Interleaved1F1B"],
    "3d_fsdp2_tp2_pp2": [
        "parallelism=fsdp_tp_pp",
        "launcher.nproc_per_node=8",
        "training.local_batch_size=4",
        "parallelism.pipeline_parallel_microbatch_size=2",
    ],
    "fsdp2_ac_full": [*FSDP2, "activation_checkpoint.mode=full"],
    "fsdp2_ac_selective": [*FSDP2, "activation_checkpoint.mode=selective"],
    "fsdp2_float8": [*FSDP2, "quantize=float8"],
    "larger_fsdp2": [*LARGER, *FSDP2],
    "larger_tp2": [*LARGER, "parallelism=tp", "launcher.nproc_per_node=2", "training.local_batch_size=8"],
    "larger_pp2_1F1B": [*LARGER, *PP2],
    # Mixture of experts (8.9M parameters, 8 experts, top-2): FSDP, and expert parallelism beside
    # FSDP and TP (experts split over the ranks, tokens exchanged by all-to-all).
    "moe_fsdp2": [*MOE, *FSDP2],
    "moe_fsdp2_ep2": [*MOE, *FSDP2, "parallelism.expert_parallel_degree=2"],
    "moe_fsdp4_ep2": [*MOE, *FSDP4, "parallelism.expert_parallel_degree=2"],
    "moe_tp2_ep2": [*MOE, "parallelism=tp", "launcher.nproc_per_node=2", "training.local_batch_size=8"]
    + ["parallelism.expert_parallel_degree=2"],
    # DeepSeek-V3's shape (8.0M parameters): latent attention, a dense first layer, a shared
    # expert, sigmoid routing over groups.
    "deepseek_fsdp2_ep2": [*DEEPSEEK, *FSDP2, "parallelism.expert_parallel_degree=2"],
    "deepseek_tp2": [*DEEPSEEK, "parallelism=tp", "launcher.nproc_per_node=2", "training.local_batch_size=8"],
    # TP splitting each expert's hidden dim instead (no EP: the slices' tokens gathered).
    "moe_tp2": [*MOE, "parallelism=tp", "launcher.nproc_per_node=2", "training.local_batch_size=8"],
    "moe_fsdp2_tp2_ep2_etp2": [*MOE, "parallelism=fsdp_tp", "launcher.nproc_per_node=4", "launcher.oversubscribe=true"]
    + [
        "training.local_batch_size=4",
        "parallelism.expert_parallel_degree=2",
        "parallelism.expert_tensor_parallel_degree=2",
    ],
}


def measured(workdir: Path, overrides: list[str], steps: int) -> dict[str, float]:
    """A real run: the median step seconds of the steps after its MLflow writer's start-up (the
    first after it and the last, the audit's, left out) and the audit of step `steps`. Where the
    ranks fill the cores the writer starts after step 1 and its start-up slows the next several
    steps by up to half (see tracking/writer.py); it prints the run's id once it has created it, a
    moment before its start-up ends."""
    db = workdir / "mlflow.db"
    audit = ["profiling=memory", f"profiling.memory_snapshot_freq={steps}", f"training.steps={steps}"]
    command = [sys.executable, "-m", "titan_exp", *COMMON, *overrides, *audit, f"tracking.uri=sqlite:///{db}"]
    _, lines = stream([*command, f"hydra.run.dir={workdir}/run"], env_with(1), f"step {steps:5d}")
    created = next((i for i, line in enumerate(lines) if line.startswith("MLflow run ")), None)
    if created is None:
        raise SystemExit(f"{workdir.name}: its MLflow writer never said it created the run (see {workdir}/run)")
    seconds = [float(line.split(" step ")[1].split("s")[0]) for line in lines[created:] if line.startswith("step ")]
    if len(seconds) < 4:
        raise SystemExit(f"{workdir.name}: {len(seconds)} steps after the writer's start-up; raise --steps")
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    [run] = client.search_runs(client.get_experiment_by_name("titan_exp").experiment_id, max_results=1)
    metrics = run.data.metrics
    return {
        "step_s": statistics.median(seconds[1:-1]),
        "peak_gib": metrics["memory/audit_memtracker_peak_gib"],
        "tps_per_device": metrics[names.TPS_MEAN],
    }


def predicted(overrides: list[str]) -> dict[str, float]:
    job = compose_point([*COMMON, *overrides])
    prediction = plan_one(job)
    rank0 = rank_memory(workload(job.config, "cpu"), pp_rank=0)  # the rank the audit measures
    return {
        "step_s": prediction.step.total,
        "peak_gib": rank0.active / GIB,  # tensors, as MemTracker counts them
        "tps_per_device": prediction.tps_per_device,
        "compute": prediction.sources["compute"],
    }


def kendall_tau(a: list[float], b: list[float]) -> float:
    pairs = list(itertools.combinations(range(len(a)), 2))
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs
    )
    return score / len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="runs per layout (their spread: the noise)")
    args = parser.parse_args()
    os.chdir(REPO)  # the planner's relative paths (outputs/cache) are the training runs'
    register_schema()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            runs = [measured(Path(tmp) / f"{name}_{i}", LAYOUTS[name], args.steps) for i in range(args.repeats)]
            rows[name] = {
                "predicted": predicted(LAYOUTS[name]),
                "measured": {key: statistics.median(run[key] for run in runs) for key in runs[0]},
                "step_s_runs": [run["step_s"] for run in runs],
            }
            row = rows[name]
            row["noise_pct"] = 100 * (max(row["step_s_runs"]) / min(row["step_s_runs"]) - 1)
            for key in ("peak_gib", "step_s"):
                row[f"{key}_error_pct"] = 100 * (row["predicted"][key] / row["measured"][key] - 1)
            print(
                f"{name:22s} memory {row['predicted']['peak_gib']:.3f}/{row['measured']['peak_gib']:.3f} GiB "
                f"({row['peak_gib_error_pct']:+.1f}%)  step {row['predicted']['step_s']:.3f}/"
                f"{row['measured']['step_s']:.3f} s ({row['step_s_error_pct']:+.1f}%)"
                + (f"  runs {row['step_s_runs']} (noise {row['noise_pct']:.1f}%)" if args.repeats > 1 else ""),
                flush=True,
            )
    names = list(rows)
    summary = {
        "memory_max_abs_error_pct": max(abs(rows[n]["peak_gib_error_pct"]) for n in names),
        "step_time_mape_pct": statistics.mean(abs(rows[n]["step_s_error_pct"]) for n in names),
        "step_time_noise_mean_pct": statistics.mean(rows[n]["noise_pct"] for n in names),
        "tps_kendall_tau": kendall_tau(
            [rows[n]["predicted"]["tps_per_device"] for n in names],
            [rows[n]["measured"]["tps_per_device"] for n in names],
        )
        if len(names) > 1
        else None,
    }
    print("\n| layout | predicted GiB | measured GiB | error | predicted step s | measured step s | error |")
    print("|---|---|---|---|---|---|---|")
    for n in names:
        r = rows[n]
        print(
            f"| {n} | {r['predicted']['peak_gib']:.3f} | {r['measured']['peak_gib']:.3f} | "
            f"{r['peak_gib_error_pct']:+.1f}% | {r['predicted']['step_s']:.3f} | {r['measured']['step_s']:.3f} | "
            f"{r['step_s_error_pct']:+.1f}% |"
        )
    print(json.dumps({"summary": summary, "layouts": rows}, indent=2))


if __name__ == "__main__":
    main()

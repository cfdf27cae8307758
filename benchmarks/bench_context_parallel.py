"""Peak memory per rank under context parallelism: the debug Llama at seq_len 4096, local batch 1,
cp = 1 (one rank), 2 and 4 (FSDP over the cp ranks, the all-gather attention), on CPU ranks.

Measured by the memory audit (profiling=memory: torch's MemTracker over step 2, tensor-level, rank 0)
and, beside it, the analytic estimate (estimate/memory.py) with the part that is other ranks' gathered
K and V. Activations should fall roughly as 1/cp plus the gathered K/V, which grows towards a whole
sequence's worth per layer.

Prints a table and one JSON object. Usage: python benchmarks/bench_context_parallel.py [--cp 1 2 4]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench_vs_plain import env_with, stream
from mlflow import MlflowClient

from titan_exp import metric_names as names
from titan_exp.estimate.memory import gathered_kv, rank_memory
from titan_exp.estimate.workload import Workload
from titan_exp.models.config import ModelConfig
from titan_exp.parallel.config import ActivationCheckpointConfig, ParallelismConfig
from titan_exp.units import GIB

SEQ_LEN = 4096
JOB = [
    "model=llama3_debug",
    f"model.max_seq_len={SEQ_LEN}",
    f"training.seq_len={SEQ_LEN}",
    "training.local_batch_size=1",
    "training.steps=2",
    "data=synthetic",
    "metrics.log_freq=1",
    "launcher.device=cpu",
    "launcher.oversubscribe=true",
    "profiling=memory",
    "profiling.memory_snapshot_freq=2",
]
AUDITED = ("peak", "activations", "parameters", "gradients", "optimizer_state", "temporary")


def measured(workdir: Path, cp: int) -> dict[str, float]:
    """The audit's figures (GiB) of one job, read back from its MLflow run."""
    db = workdir / "mlflow.db"
    layout = ["parallelism=single"] if cp == 1 else ["parallelism=cp", f"launcher.nproc_per_node={cp}"]
    command = [sys.executable, "-m", "titan_exp", *JOB, *layout, f"tracking.uri=sqlite:///{db}"]
    stream([*command, f"hydra.run.dir={workdir}/cp{cp}"], env_with(1), "step     2")
    client = MlflowClient(f"sqlite:///{db}")
    [run] = client.search_runs(client.get_experiment_by_name("titan_exp").experiment_id, max_results=1)
    metrics = run.data.metrics
    found = {name: metrics.get(f"memory/audit_{name}_gib", 0.0) for name in AUDITED}
    found["cpu_rss_peak"] = metrics.get(names.CPU_RSS_PEAK_GIB, 0.0)
    return found


def estimated(cp: int) -> dict[str, float]:
    """estimate/memory.py's activations (GiB) and the gathered K/V in them, for rank 0 of the same job."""
    model = ModelConfig()  # the defaults are the debug model's
    layout = ParallelismConfig(data_parallel_shard_degree=1, context_parallel_degree=cp)
    estimate = rank_memory(Workload(model, layout, ActivationCheckpointConfig(), 1, SEQ_LEN, device="cpu"))
    kv = model.n_layers * gathered_kv(model, 1, SEQ_LEN, cp) * 4
    return {"activations": estimate.activations / GIB, "gathered_kv": kv / GIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            report[cp] = {"measured_gib": measured(Path(tmp) / f"cp{cp}", cp), "estimated_gib": estimated(cp)}
    base = report[args.cp[0]]["measured_gib"]["activations"]
    print(f"{'cp':>3} {'peak':>7} {'activations':>12} {'vs cp=' + str(args.cp[0]):>9} {'est. act.':>10} "
          f"{'est. gathered K/V':>18} {'params':>7} {'RSS peak':>9}  (GiB, rank 0)")  # fmt: skip
    for cp, row in report.items():
        m, e = row["measured_gib"], row["estimated_gib"]
        print(
            f"{cp:>3} {m['peak']:>7.3f} {m['activations']:>12.3f} {m['activations'] / base:>9.2f} "
            f"{e['activations']:>10.3f} {e['gathered_kv']:>18.3f} {m['parameters']:>7.3f} {m['cpu_rss_peak']:>9.3f}"
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Runs read back from MLflow: which runs to compare, and one summary per training job with the
figures of the strategy table."""

import statistics
from dataclasses import dataclass, field

from titan_exp.tracking.run import PARENT_TAG, ROLE_TAG

# Steady-state figures only (everything after step 1, which includes start-up and compilation); a
# run that never got past its first log interval has none.
TPS_KEY = "throughput/tps_per_device_mean"
MFU_KEY = "throughput/mfu_pct_mean"
# CUDA's allocator peak, else the CPU resident-set peak: never mixed in one figure (see metrics/memory.py).
MEMORY_KEYS = (("memory/max_active_gib", "active"), ("memory/cpu_rss_peak_gib", "cpu rss"))
LOSS_KEY = "loss/global_avg"
# The role tag of a prediction run (python -m titan_exp plan): compared with, never as, a training run.
PREDICTION_ROLE = "prediction"


@dataclass
class RunSummary:
    run_id: str
    name: str
    status: str
    model: str
    strategy: str
    quantize: str
    mesh: dict[str, int]
    device: str
    # Tokens each rank processes per micro-batch: runs that differ here do not scale the same work.
    tokens_per_micro_batch: int
    world_size: int
    tps_per_device: float | None
    mfu_pct: float | None
    peak_memory_gib: float | None
    memory_kind: str
    final_loss: float | None
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    failure_reason: str = ""
    # TPS/device over that of the smallest world size in the same family (filled by add_scaling_efficiency).
    scaling_efficiency: float | None = None
    # The latest prediction of the same layout in the experiment (python -m titan_exp plan), if any.
    predicted_tps_per_device: float | None = None
    predicted_peak_memory_gib: float | None = None

    @property
    def family(self) -> tuple:
        """Runs that differ only in their data-parallel degree: the same model, strategy, precision,
        model-parallel degrees, device kind and per-rank batch. Scaling efficiency is measured
        within a family."""
        model_parallel = tuple(self.mesh.get(dim, 1) for dim in ("tp", "pp", "cp"))
        return (self.model, self.strategy, self.quantize, model_parallel, self.device, self.tokens_per_micro_batch)


def latest_sweep(client, experiment_id: str):
    runs = client.search_runs(
        [experiment_id], f"tags.`{ROLE_TAG}` = 'sweep'", order_by=["attributes.start_time DESC"], max_results=1
    )
    return runs[0] if runs else None


def sweep_points(client, parent) -> list:
    """The training runs of a sweep, in the order they started."""
    query = f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'"
    return client.search_runs([parent.info.experiment_id], query, order_by=["attributes.start_time ASC"])


def experiment_training_runs(client, experiment_id: str) -> list:
    """Every training run of an experiment (sweep and plan parents, predictions left out), in the
    order they started."""
    runs = client.search_runs([experiment_id], order_by=["attributes.start_time ASC"])
    return [run for run in runs if run.data.tags.get(ROLE_TAG) not in ("sweep", "plan", PREDICTION_ROLE)]


def latest_prediction(client, run):
    """The newest prediction run of the same layout as `run`, in its experiment; None if none."""
    key = run.data.tags.get("layout_key")
    if not key:
        return None
    query = f"tags.`{ROLE_TAG}` = '{PREDICTION_ROLE}' and tags.layout_key = '{key}'"
    found = client.search_runs([run.info.experiment_id], query, order_by=["attributes.start_time DESC"], max_results=1)
    return found[0] if found else None


def loss_curve(client, run_id: str, key: str = LOSS_KEY) -> list[tuple[int, float]]:
    """(step, global average loss, or the metric `key`) of every logged step, in step order. A step
    logged twice (a run resumed from a checkpoint older than its last steps) counts once, as its
    latest logging."""
    latest = {m.step: m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}
    return sorted(latest.items())


def summarize(client, run) -> RunSummary:
    metrics, tags, params = run.data.metrics, run.data.tags, run.data.params
    memory_key, memory_kind = next(((k, kind) for k, kind in MEMORY_KEYS if k in metrics), (None, ""))
    curve = loss_curve(client, run.info.run_id)
    return RunSummary(
        run_id=run.info.run_id,
        name=run.info.run_name,
        status=run.info.status,
        model=tags.get("model", "?"),
        strategy=tags.get("strategy", "?"),
        quantize=tags.get("quantize", "none"),
        mesh=parse_mesh(tags.get("mesh", "")),
        device=tags.get("device", "?"),
        tokens_per_micro_batch=int(params.get("training.local_batch_size", 0)) * int(params.get("training.seq_len", 0)),
        world_size=int(tags.get("world_size", 0) or 0),
        tps_per_device=metrics.get(TPS_KEY),
        mfu_pct=metrics.get(MFU_KEY),
        peak_memory_gib=max(m.value for m in client.get_metric_history(run.info.run_id, memory_key))
        if memory_key
        else None,
        memory_kind=memory_kind,
        final_loss=curve[-1][1] if curve else None,
        loss_curve=curve,
        failure_reason=tags.get("failure_reason", ""),
        **_predicted(client, run),
    )


def _predicted(client, run) -> dict[str, float | None]:
    prediction = latest_prediction(client, run)
    metrics = prediction.data.metrics if prediction else {}
    return {
        "predicted_tps_per_device": metrics.get("prediction/tps_per_device"),
        "predicted_peak_memory_gib": metrics.get("prediction/peak_memory_gib"),
    }


def add_scaling_efficiency(summaries: list[RunSummary]) -> None:
    """Each finished run's TPS/device relative to the median TPS/device of its family's smallest
    world size (failed runs neither get one nor serve as the baseline)."""
    families: dict[tuple, list[RunSummary]] = {}
    for summary in summaries:
        if summary.status == "FINISHED" and summary.tps_per_device is not None and summary.world_size > 0:
            families.setdefault(summary.family, []).append(summary)
    for members in families.values():
        smallest = min(s.world_size for s in members)
        baseline = statistics.median(s.tps_per_device for s in members if s.world_size == smallest)
        for summary in members:
            summary.scaling_efficiency = summary.tps_per_device / baseline if baseline > 0 else None


def parse_mesh(text: str) -> dict[str, int]:
    """'dp_shard2·tp2' → {'dp_shard': 2, 'tp': 2}; 'single' → {}."""
    mesh = {}
    for part in text.split("·"):
        name = part.rstrip("0123456789")
        if name and name != part:
            mesh[name] = int(part[len(name) :])
    return mesh

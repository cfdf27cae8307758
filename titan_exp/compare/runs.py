"""Runs read back from MLflow: which runs to compare, and one summary per training job with the
figures of the strategy table."""

import statistics
import string
from dataclasses import dataclass, field

from titan_exp import metric_names as names
from titan_exp.tracking.run import PARENT_TAG, ROLE_TAG, UNREAD_KEYS_PARAM

# CUDA's allocator peak, else the CPU resident-set peak: never mixed in one figure (see metrics/memory.py).
MEMORY_KEYS = ((names.MAX_ACTIVE_GIB, "active"), (names.CPU_RSS_PEAK_GIB, "cpu rss"))
# The role tag of a prediction run (python -m titan_exp plan): compared with, never as, a training run.
PREDICTION_ROLE = "prediction"


# Params that say how a run was tracked, planned or what it derived, not what it was asked to compute,
# and where it kept its checkpoints (by default a folder of its own, another in every run): never a
# difference between runs.
NOT_CHOICES = ("tracking.", "derived/", "plan.", "parity.", "sweep.", "checkpoint.folder")
# Params that say where the ranks ran and how the run was kept: not what its ranks computed, so
# runs that differ only here scale alike (the columns still show them where they vary).
PLACEMENT = ("launcher.", "data.cache_dir", "profiling.save_")
# What changes with the data-parallel size alone when a layout is scaled out (strong or weak), and
# a key read or not by that size (FSDP's resharding: nothing is sharded on one device).
DATA_PARALLEL_DEGREES = ("parallelism.data_parallel_shard_degree", "parallelism.data_parallel_replicate_degree")
# Under a held global batch (job/held_batch.py) the local batch follows the data-parallel size too.
DATA_PARALLEL_KEYS = (
    *DATA_PARALLEL_DEGREES,
    "training.global_batch_size",
    "training.local_batch_size",
    "parallelism.fsdp_reshard_after_forward",
)
# Params the strategy table shows in columns of their own (the run's name gives the degrees).
SHOWN_ELSEWHERE = (
    *DATA_PARALLEL_DEGREES,
    "parallelism.tensor_parallel_degree",
    "parallelism.pipeline_parallel_degree",
    "parallelism.context_parallel_degree",
    "parallelism.expert_parallel_degree",
    "launcher.nproc_per_node",
    "launcher.nodes",
    "training.global_batch_size",
)
# The fewest steady log intervals that give a spread (fewer: the quartiles are the values themselves).
MIN_INTERVALS = 3


@dataclass
class RunSummary:
    run_id: str
    name: str
    status: str
    mesh: dict[str, int]
    device: str
    world_size: int
    tps_per_device: float | None
    mfu_pct: float | None
    peak_memory_gib: float | None
    memory_kind: str
    final_loss: float | None
    # The resolved config and derived facts as MLflow holds them ({"training.steps": "50", ...}).
    params: dict[str, str] = field(default_factory=dict)
    validation_loss: float | None = None
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    failure_reason: str = ""
    # TPS/device over that of the smallest data-parallel size in the same family, where the family
    # has more than one (filled by add_scaling_efficiency).
    scaling_efficiency: float | None = None
    # The latest prediction of the same layout in the experiment (python -m titan_exp plan), if any.
    predicted_tps_per_device: float | None = None
    predicted_peak_memory_gib: float | None = None
    # A MoE run's expert load at its last step: the worst layer's busiest expert over the mean.
    expert_load_imbalance: float | None = None
    # The TPS/device of each log interval that tps_per_device covers (steady_intervals).
    steady_tps: list[float] = field(default_factory=list)
    # The letters of the runs whose TPS/device it is not told apart from (filled by add_tps_groups).
    tps_group: str = ""

    @property
    def tps_quartiles(self) -> tuple[float, float, float] | None:
        """(lower quartile, median, upper quartile) of steady_tps; None below MIN_INTERVALS intervals."""
        if len(self.steady_tps) < MIN_INTERVALS:
            return None
        q1, median, q3 = statistics.quantiles(self.steady_tps, n=4, method="inclusive")
        return q1, median, q3

    @property
    def batch(self) -> tuple[str, str, str]:
        """(global batch, tokens per optimizer step, accumulation) as the run logged them: what makes
        two runs' losses and throughputs comparable."""
        p = self.params
        tokens = p.get("derived/global_batch_tokens", "")
        return (
            p.get("training.global_batch_size", ""),
            f"{int(tokens):,}" if tokens.isdigit() else tokens,
            p.get("derived/gradient_accumulation_steps", ""),
        )

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.get("dp_replicate", 1) * self.mesh.get("dp_shard", 1)

    @property
    def family(self) -> tuple:
        """What runs that differ only in their data-parallel size share: every choice of the config
        that the layout reads but where the ranks ran, the device kind, and what the sweep held
        fixed as the size changed: the tokens per step (strong scaling: a sweep's default,
        job/held_batch.py) or the local batch (weak scaling: sweep.batch=per_rank, and runs that
        logged no such choice). Scaling efficiency is measured within a family."""
        kept = (
            (key, value)
            for key, value in self.params.items()
            if not key.startswith(NOT_CHOICES + PLACEMENT) and key not in DATA_PARALLEL_KEYS and self.reads(key)
        )
        if self.params.get("sweep.batch") == "global":
            held = ("tokens/step", self.params.get("derived/global_batch_tokens", ""))
        else:
            held = ("local batch", self.params.get("training.local_batch_size", ""))
        return (self.device, held, *sorted(kept))

    def reads(self, key: str) -> bool:
        """Whether the run's layout reads this config key (runs logged before we recorded it: all)."""
        return key not in self.params.get(UNREAD_KEYS_PARAM, "").split(",")

    @property
    def oversubscribed(self) -> bool:
        """CPU ranks that time-shared cores (more rank threads than rank 0's cores on its node): the
        throughput measures the sharing, not the layout."""
        params = self.params
        cores = cpu_count(params.get("derived/cpu_set", ""))
        if self.device != "cpu" or not cores:
            return False
        threads = int(params.get("launcher.nproc_per_node", 1)) * int(params.get("launcher.cpu_threads_per_rank", 1))
        return threads > cores


def cpu_count(cpu_set: str) -> int:
    """'0-2,5' → 4; '' → 0."""
    count = 0
    for part in filter(None, cpu_set.split(",")):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def varying_params(summaries: list[RunSummary]) -> list[str]:
    """The config keys with different values in runs that read them (those the table shows
    elsewhere left out), in config order: what a comparison must say beside each run."""
    keys = dict.fromkeys(key for s in summaries for key in s.params)
    return [
        key
        for key in keys
        if not key.startswith(NOT_CHOICES)
        and key not in SHOWN_ELSEWHERE
        and len({s.params.get(key, "") for s in summaries if s.reads(key)}) > 1
    ]


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


def loss_curve(client, run_id: str, key: str = names.LOSS) -> list[tuple[int, float]]:
    """(step, global average loss, or the metric `key`) of every logged step, in step order. A step
    logged twice (a run resumed from a checkpoint older than its last steps) counts once, as its
    latest logging."""
    latest = {m.step: m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}
    return sorted(latest.items())


def steady_intervals(tps: list, steady: list) -> list[float]:
    """The TPS/device of each log interval that the run's last steady TPS/device covers, in the
    order logged: metrics/throughput.py's steady state read back from the histories it left (`tps`,
    `steady`: of TPS and TPS_MEAN, MLflow Metrics, one record's figures sharing step and timestamp).
    A meter logs no steady figure at its first interval (start-up; a resumed run starts a new meter),
    and one equal to the interval's own where the steady state starts afresh with that interval."""
    steady_at = {(m.step, m.timestamp): m.value for m in steady}
    window: list[float] = []
    for m in sorted(tps, key=lambda m: (m.timestamp, m.step)):
        mean = steady_at.get((m.step, m.timestamp))
        if mean is None:
            window = []
        elif mean == m.value:
            window = [m.value]
        else:
            window.append(m.value)
    return window


def summarize(client, run) -> RunSummary:
    metrics, tags = run.data.metrics, run.data.tags
    memory_key, memory_kind = next(((k, kind) for k, kind in MEMORY_KEYS if k in metrics), (None, ""))
    curve = loss_curve(client, run.info.run_id)
    tps, steady = (client.get_metric_history(run.info.run_id, key) for key in (names.TPS, names.TPS_MEAN))
    return RunSummary(
        run_id=run.info.run_id,
        name=run.info.run_name,
        status=run.info.status,
        mesh=parse_mesh(tags.get("mesh", "")),
        device=tags.get("device", "?"),
        world_size=int(tags.get("world_size", 0) or 0),
        tps_per_device=metrics.get(names.TPS_MEAN),  # steady state: after the first log interval
        mfu_pct=metrics.get(names.MFU_MEAN),
        peak_memory_gib=max(m.value for m in client.get_metric_history(run.info.run_id, memory_key))
        if memory_key
        else None,
        memory_kind=memory_kind,
        final_loss=curve[-1][1] if curve else None,
        params=dict(run.data.params),
        validation_loss=metrics.get(names.VALIDATION_LOSS),
        loss_curve=curve,
        failure_reason=tags.get("failure_reason", ""),
        expert_load_imbalance=metrics.get(names.LOAD_IMBALANCE),
        steady_tps=steady_intervals(tps, steady),
        **_predicted(client, run),
    )


def _predicted(client, run) -> dict[str, float | None]:
    prediction = latest_prediction(client, run)
    metrics = prediction.data.metrics if prediction else {}
    return {
        "predicted_tps_per_device": metrics.get("prediction/tps_per_device"),
        "predicted_peak_memory_gib": metrics.get("prediction/peak_memory_gib"),
    }


def families(summaries: list[RunSummary]) -> list[list[RunSummary]]:
    """The runs grouped by family, in the order each family first appears."""
    grouped: dict[tuple, list[RunSummary]] = {}
    for summary in summaries:
        grouped.setdefault(summary.family, []).append(summary)
    return list(grouped.values())


def add_scaling_efficiency(summaries: list[RunSummary]) -> None:
    """Each finished run's TPS/device relative to the median TPS/device of its family's smallest
    data-parallel size, in families that hold more than one data-parallel size (elsewhere there is
    no scaling to measure; failed runs neither get one nor serve as the baseline)."""
    measured = [s for s in summaries if s.status == "FINISHED" and s.tps_per_device is not None]
    for members in families(measured):
        sizes = {s.data_parallel_size for s in members}
        if len(sizes) < 2:
            continue
        baseline = statistics.median(s.tps_per_device for s in members if s.data_parallel_size == min(sizes))
        for summary in members:
            summary.scaling_efficiency = summary.tps_per_device / baseline if baseline > 0 else None


def best_first(summaries: list[RunSummary]) -> list[RunSummary]:
    """Finished runs by TPS/device, highest first, then the rest in their order."""
    measured = [s for s in summaries if s.status == "FINISHED" and s.tps_per_device is not None]
    rest = [s for s in summaries if all(s is not m for m in measured)]
    return sorted(measured, key=lambda s: -s.tps_per_device) + rest


def add_tps_groups(summaries: list[RunSummary]) -> None:
    """Letters for the finished runs with a spread, the first run's group `a`: two runs share a
    letter where their TPS/device interquartile ranges overlap (the difference between them lies
    within the spread over their intervals), so runs with no letter in common are told apart."""
    ranged = [s for s in summaries if s.status == "FINISHED" and s.tps_quartiles]
    spans = [(q1, q3) for q1, _, q3 in (s.tps_quartiles for s in ranged)]
    # Ranges that overlap pairwise share a point, the highest of their lower quartiles: every
    # largest set of them is the ranges that hold one range's lower quartile.
    holding = [frozenset(i for i, (q1, q3) in enumerate(spans) if q1 <= low <= q3) for low, _ in spans]
    groups = sorted({g for g in holding if not any(g < other for other in holding)}, key=min)
    letters = [_group_name(n) for n in range(len(groups))]
    separator = "" if len(groups) <= len(string.ascii_lowercase) else ","  # `ab` while letters are single
    for i, summary in enumerate(ranged):
        summary.tps_group = separator.join(letter for letter, group in zip(letters, groups) if i in group)


def _group_name(n: int) -> str:
    """0 → a, 25 → z, 26 → aa, 27 → ab (as a spreadsheet's columns)."""
    letters = string.ascii_lowercase
    return (_group_name(n // 26 - 1) if n >= 26 else "") + letters[n % 26]


def parse_mesh(text: str) -> dict[str, int]:
    """'dp_shard2·tp2' → {'dp_shard': 2, 'tp': 2}; 'single' → {}."""
    mesh = {}
    for part in text.split("·"):
        name = part.rstrip("0123456789")
        if name and name != part:
            mesh[name] = int(part[len(name) :])
    return mesh

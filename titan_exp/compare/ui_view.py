"""A link into MLflow's own UI that opens on the comparison: the model-training runs table of the
latest sweep's points (or of every run), the strategy columns shown in order, each wide enough for
its header and values, sorted by TPS/device; with
CHARTS_VIEW added, MLflow's run charts of the same runs: the loss curves overlaid, TPS/device, MFU
and peak memory per run, and each log interval's TPS/device overlaid (its spread, which the strategy
table gives as quartiles).

MLflow 3's UI shares a table's state (search, sort, columns) through an experiment tag,
`mlflow.sharedViewState.<key>`, opened by `?viewStateShareKey=<key>`; `workflowType=machine_learning`
opens the model-training view instead of the GenAI overview."""

import json

from titan_exp import metric_names as names
from titan_exp.compare.runs import (
    MEMORY_KEYS,
    experiment_training_runs,
    latest_sweep,
    sweep_points,
)
from titan_exp.tracking.run import PARENT_TAG
from titan_exp.tracking.store import with_retries

_SHARED_VIEW_TAG = "mlflow.sharedViewState."
# The strategy table's columns, as MLflow names them ("metrics.`key`", its canonical column keys).
STRATEGY_COLUMNS = (
    "tags.`layout`",
    "tags.`world_size`",
    "tags.`mesh`",
    *(f"metrics.`{key}`" for key in (names.TPS_MEAN, names.MFU_MEAN, *(key for key, _ in MEMORY_KEYS), names.LOSS)),
    # The work per optimizer step: layouts compare only where it is the same (job/held_batch.py).
    "params.`training.global_batch_size`",
    "params.`derived/global_batch_tokens`",
    "params.`derived/gradient_accumulation_steps`",
    "tags.`status`",
)
# A MoE run's expert load, after the memory (MLflow shows no column for a metric no run has).
EXPERT_LOAD_COLUMN = f"metrics.`{names.LOAD_IMBALANCE}`"

_SECTION = "titan_exp-strategy"
# The charts view: the loss curves overlaid, one bar per run of each strategy figure, and the
# TPS/device of each log interval overlaid.
STRATEGY_CHARTS = (
    ("LINE", names.LOSS, "loss"),
    ("BAR", names.TPS_MEAN, "TPS/device"),
    ("LINE", names.TPS, "TPS/device per log interval"),
    ("BAR", names.MFU_MEAN, "MFU %"),
    *(("BAR", key, f"peak memory GiB ({kind})") for key, kind in MEMORY_KEYS),
)
# MLflow's UI shows the view's table by default, its charts with this added to the link.
CHARTS_VIEW = "&compareRunsMode=CHART"


def _chart(kind: str, metric: str, title: str) -> dict:
    """One chart card as MLflow's UI keeps it (RunsChartsCardConfig's fields)."""
    card = {
        "uuid": f"titan_exp-{metric}",
        "type": kind,
        "runsCountToCompare": 20,
        "metricSectionId": _SECTION,
        "deleted": False,
        "isGenerated": False,
        "displayName": title,
        "metricKey": metric,
        "selectedMetricKeys": [metric],
    }
    if kind == "LINE":
        card |= {"lineSmoothness": 0, "scaleType": "linear", "xAxisScaleType": "linear", "xAxisKey": "step"}
        card |= {"selectedXAxisMetricKey": "", "yAxisKey": "metric", "yAxisExpressions": [], "ignoreOutliers": False}
        card |= {"range": {}, "useGlobalXaxisKey": True, "useGlobalLineSmoothing": True}
    return card


def strategy_columns(runs: list) -> list[str]:
    """The view's columns for `runs`: the strategy columns, and the experts' load where a run has experts."""
    columns = list(STRATEGY_COLUMNS)
    if any(names.LOAD_IMBALANCE in run.data.metrics for run in runs):
        columns.insert(columns.index(f"metrics.`{names.LOSS}`"), EXPERT_LOAD_COLUMN)
    return columns


def _widths(columns: list[str], runs: list) -> dict[str, int]:
    """Pixels for each column that show its whole header (the key) and each of `runs`' values in
    it, at about 7 px a character in MLflow's font beside the sort icon; MLflow gives every column
    100, cutting most of these keys."""
    widths = {}
    for column in columns:
        kind, key = column.split(".")[0], column.split("`")[1]
        values = [str(getattr(run.data, kind).get(key, "")) for run in runs]
        widths[column] = 7 * max(len(key), *map(len, values)) + 40
    return widths


def comparison_link(client, base_url: str, experiment_name: str) -> str | None:
    """The link (None: no such experiment). Writes the view it opens as a tag of the experiment."""
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return None
    sweep = latest_sweep(client, experiment.experiment_id)
    runs = sweep_points(client, sweep) if sweep else experiment_training_runs(client, experiment.experiment_id)
    key = f"titan_exp-{sweep.info.run_id if sweep else 'all'}"
    columns = strategy_columns(runs)
    state = {
        "searchFilter": f"tags.`{PARENT_TAG}` = '{sweep.info.run_id}'" if sweep else "",
        "orderByKey": f"metrics.`{names.TPS_MEAN}`",
        "orderByAsc": False,
        "selectedColumns": columns,
        # MLflow applies widths to the columns named in columnOrder only.
        "columnOrder": columns,
        "columnWidths": _widths(columns, runs),
        "compareRunCharts": [_chart(*chart) for chart in STRATEGY_CHARTS],
        "compareRunSections": [
            {"uuid": _SECTION, "name": "Strategy comparison", "display": True, "isReordered": True, "deleted": False}
        ],
        "isAccordionReordered": True,
    }
    tag = _SHARED_VIEW_TAG + key
    with_retries(lambda: client.set_experiment_tag(experiment.experiment_id, tag, json.dumps(state)))
    query = f"workflowType=machine_learning&viewStateShareKey={key}"
    return f"{base_url}/#/experiments/{experiment.experiment_id}/runs?{query}"

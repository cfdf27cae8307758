"""A link into MLflow's own UI that opens on the comparison: the model-training runs table of the
latest sweep's points (or of every run), the strategy columns shown, sorted by TPS/device.

MLflow 3's UI shares a table's state (search, sort, columns) through an experiment tag,
`mlflow.sharedViewState.<key>`, opened by `?viewStateShareKey=<key>`; `workflowType=machine_learning`
opens the model-training view instead of the GenAI overview."""

import json

from titan_exp.compare.runs import _MFU_KEY, _TPS_KEY, latest_sweep
from titan_exp.tracking.run import PARENT_TAG
from titan_exp.tracking.store import with_retries

_SHARED_VIEW_TAG = "mlflow.sharedViewState."
# The strategy table's columns, as MLflow names them ("metrics.`key`", its canonical column keys).
STRATEGY_COLUMNS = (
    "tags.`layout`",
    "tags.`world_size`",
    "tags.`mesh`",
    f"metrics.`{_TPS_KEY}`",
    f"metrics.`{_MFU_KEY}`",
    "metrics.`memory/max_active_gib`",
    "metrics.`memory/cpu_rss_peak_gib`",
    "metrics.`loss/global_avg`",
    "tags.`status`",
)


def comparison_link(client, base_url: str, experiment_name: str) -> str | None:
    """The link (None: no such experiment). Writes the view it opens as a tag of the experiment."""
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return None
    sweep = latest_sweep(client, experiment.experiment_id)
    key = f"titan_exp-{sweep.info.run_id if sweep else 'all'}"
    state = {
        "searchFilter": f"tags.`{PARENT_TAG}` = '{sweep.info.run_id}'" if sweep else "",
        "orderByKey": f"metrics.`{_TPS_KEY}`",
        "orderByAsc": False,
        "selectedColumns": list(STRATEGY_COLUMNS),
    }
    tag = _SHARED_VIEW_TAG + key
    with_retries(lambda: client.set_experiment_tag(experiment.experiment_id, tag, json.dumps(state)))
    query = f"workflowType=machine_learning&viewStateShareKey={key}"
    return f"{base_url}/#/experiments/{experiment.experiment_id}/runs?{query}"

"""The MLflow server `titan_exp ui` runs: MLflow's own (`mlflow server --app-name titan_exp`, an
`mlflow.app` entry point), whose page starts a browser in MLflow's model-training view.

MLflow 3.17 no longer picks an experiment's view from its `mlflow.experimentKind` tag: the view comes
from the link's `workflowType` or else the browser's last choice (localStorage), GenAI by default. A
browser that has never chosen thus opened the project's experiments on an empty GenAI overview. This
page sets that choice to model training, once, where the browser has none; a user's own choice stays."""

from flask import Response, request
from mlflow.server import app as flask_app
from mlflow.server.fastapi_app import app  # noqa: F401  (what uvicorn serves: MLflow's app, this hook added)

# MLflow's UI keeps the choice under "<key>_v<version>", JSON-encoded (its useLocalStorage hook).
_WORKFLOW_KEY = "mlflow.workflowType_v1"
_MODEL_TRAINING_FIRST = (
    f"<script>try{{localStorage.getItem('{_WORKFLOW_KEY}')||"
    f"localStorage.setItem('{_WORKFLOW_KEY}','\"machine_learning\"')}}catch(e){{}}</script>"
).encode()


@flask_app.after_request
def _model_training_view_first(response: Response) -> Response:
    """Adds the choice to MLflow's page (its `serve` route; artifacts, HTML ones too, pass as they are)."""
    if request.endpoint != "serve" or response.status_code != 200 or response.mimetype != "text/html":
        return response
    response.direct_passthrough = False  # a file sent as it is on disk: read it to change it
    page = response.get_data()
    if b"<head>" in page:
        response.set_data(page.replace(b"<head>", b"<head>" + _MODEL_TRAINING_FIRST, 1))
    return response

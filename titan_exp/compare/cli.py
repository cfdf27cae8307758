"""`titan_exp compare` (also `python -m titan_exp.compare`): the strategy table and plots of a sweep
(default: the latest one) or of every run of an experiment, read from MLflow.

  python -m titan_exp.compare                      # the latest sweep in outputs/mlflow.db
  python -m titan_exp.compare --sweep <parent run id>
  python -m titan_exp.compare --all --experiment titan_exp --uri http://127.0.0.1:5000
"""

import argparse
import sys
from pathlib import Path

from titan_exp.compare.report import compare_sweep, write_report
from titan_exp.compare.runs import experiment_training_runs, latest_sweep, summarize
from titan_exp.tracking.config import Store, TrackingConfig, masked
from titan_exp.tracking.store import open_experiment


def parse_args(argv: list[str]) -> argparse.Namespace:
    defaults = TrackingConfig()
    parser = argparse.ArgumentParser(prog="titan_exp compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--uri", default=defaults.uri, help=f"MLflow tracking URI (default {defaults.uri})")
    parser.add_argument("--experiment", default=defaults.experiment, help="MLflow experiment (default %(default)s)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--sweep", default="latest", help="a sweep's parent run id, or 'latest' (default)")
    target.add_argument("--all", action="store_true", help="every training run of the experiment instead of one sweep")
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write the tables and plots (default outputs/compare/<sweep run id or experiment>)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    try:
        mlflow_client, experiment = open_experiment(args.uri, args.experiment)
    except ValueError as err:
        return _fail(str(err))
    uri = Store.parse(args.uri).uri
    if args.all:
        summaries = [
            summarize(mlflow_client, run) for run in experiment_training_runs(mlflow_client, experiment.experiment_id)
        ]
        if not summaries:
            return _fail(f"--experiment={args.experiment}: it has no training runs yet")
        report = write_report(
            summaries,
            args.out or Path("outputs/compare") / args.experiment,
            f"Strategy comparison: experiment {args.experiment}",
        )
    else:
        parent_id = args.sweep
        if parent_id == "latest":
            parent = latest_sweep(mlflow_client, experiment.experiment_id)
            if parent is None:
                return _fail(
                    f"--sweep=latest: experiment {args.experiment} has no sweep; "
                    "run one with -m, or compare every run with --all"
                )
            parent_id = parent.info.run_id
        elif not _run_exists(mlflow_client, parent_id):
            return _fail(
                f"--sweep={parent_id}: no such run in {masked(uri)}; "
                "pass a sweep's parent run id (its sweep dir holds it in mlflow_parent_run_id)"
            )
        report = compare_sweep(uri, parent_id, args.out or Path("outputs/compare") / parent_id)
        print(f"logged to the sweep's parent run {parent_id} under compare/")
    print(report.markdown, end="")
    for path in report.files:
        print(f"wrote {path}")
    return 0


def _run_exists(mlflow_client, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client.get_run(run_id)
    except MlflowException:
        return False
    return True


def _fail(message: str) -> int:
    print(f"titan_exp compare: {message}", file=sys.stderr)
    return 2

"""Sweeps that optimise (hydra/sweeper=optuna, for real): each point returns sweep.objective, read
back from its MLflow run, so that Optuna's best is the best point; a failed or refused trial is the
worst and the study goes on; every batch of trials runs under the one parent run, compared at the end."""

import csv
import math
import pickle
import re

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from titan_exp import CONF_DIR
from titan_exp.objective import check_sweeper, point_return
from titan_exp.rules import ConfigError

from conftest import SMALL_MODEL, mlflow_runs, run_cli

TPS = "throughput/tps_per_device_mean"
# Trials of three steps on one CPU rank each (two side by side); Optuna's grid sampler tries each
# learning rate once, in an order of its own.
TRIALS = [*SMALL_MODEL, "experiment=smoke", "tracking=mlflow", "launcher.device=cpu", "parallelism=single"]
OPTUNA = ["training.steps=3", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid"]


def _sweeper(*overrides: str):
    """Hydra's node of the sweeper as the command line composes it."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True).hydra.sweeper


@pytest.mark.slow  # ~40 s of points; the objective of a point and a study's refusals stay in the default suite
def test_an_optuna_study_runs_under_one_parent_run_and_its_best_is_the_best_point(tmp_path, store):
    uri, db = store
    # Four trials, two at a time (two launches): two train, one fails at run time (its gradient
    # norm turns nan at step 2, a run whose gradients stop being finite), one is refused by the
    # config (a negative learning rate).
    maximise_tps = [f"sweep.objective={TPS}", "hydra.sweeper.direction=maximize"]
    trials = ["hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2", "optimizer.lr=choice(1e-3,3e-3,1e30,-1)"]
    result = run_cli([*TRIALS, uri, *OPTUNA, *maximise_tps, *trials], tmp_path, flags=("-m",))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "titan_exp: 2 sweep point(s) failed" in result.stderr
    assert "optimizer.lr=-1 failed: config error: optimizer.lr=-1.0: must be a finite number > 0" in result.stderr

    [parent] = mlflow_runs(db, sweeps=True)
    children = {float(run.data.params["optimizer.lr"]): run for run in mlflow_runs(db)}
    assert sorted(children) == [1e-3, 3e-3, 1e30]  # the refused trial started nothing
    assert {run.data.tags["mlflow.parentRunId"] for run in children.values()} == {parent.info.run_id}
    assert children[1e30].info.status == "FAILED" and TPS not in children[1e30].data.metrics
    # The learning rate blew the weights up: the run stopped before that step's update, naming it.
    reason = children[1e30].data.tags["failure_reason"]
    step = int(re.search(r"NonFiniteTraining: step (\d+): the gradient norm is (nan|inf)", reason).group(1))
    assert 1 < step <= 3 and "stopped before the optimizer update" in reason
    assert parent.info.status == "FAILED" and parent.data.tags["failure_reason"] == "2 sweep point(s) failed"

    # Optuna's best (the study ended: it wrote its results) is the fastest point as MLflow has it.
    tps = {lr: children[lr].data.metrics[TPS] for lr in (1e-3, 3e-3)}
    fastest = max(tps, key=tps.get)
    best = OmegaConf.load(tmp_path / "multirun" / "optimization_results.yaml")
    assert best.best_value == tps[fastest] and best.best_params["optimizer.lr"] == fastest

    # The comparison covers every trial that ran, from both launches.
    with open(tmp_path / "multirun" / "compare" / "strategy_table.csv") as file:
        compared = {row["run_id"] for row in csv.DictReader(file)}
    assert compared == {run.info.run_id for run in children.values()}


@pytest.mark.parametrize(
    "overrides, refusal",
    [
        (
            [f"sweep.objective={TPS}"],  # Optuna minimises unless told otherwise
            f"hydra.sweeper.direction=minimize: sweep.objective={TPS} is maximized; "
            "add hydra.sweeper.direction=maximize",
        ),
        (
            ["tracking=none"],
            "tracking.enable=False: hydra/sweeper=optuna optimises sweep.objective, read from each point's "
            "MLflow run; use tracking=mlflow",
        ),
        (["sweep.objective=tps"], "sweep.objective=tps: choose one of loss/global_avg, throughput/tps_per_device_mean"),
    ],
    ids=["the sweeper's direction", "tracking off", "an unknown objective"],
)
def test_a_study_that_could_not_optimise_is_refused_before_anything_starts(tmp_path, new_store, overrides, refusal):
    uri, db = new_store
    args = [*TRIALS, uri, *OPTUNA, "hydra.sweeper.n_trials=2", "optimizer.lr=choice(1e-3,3e-3)", *overrides]
    result = run_cli(args, tmp_path, flags=("-m",))
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    [said] = [line for line in result.stderr.splitlines() if line.startswith("titan_exp: ")]
    assert said.startswith(f"titan_exp: config error: {refusal}"), said
    assert not (tmp_path / "multirun").exists() and not db.exists()


def test_a_point_returns_its_objective_or_the_worst_value_and_whether_it_succeeded():
    done = point_return(TPS, 1234.5)
    assert done == 1234.5 and done.ok
    # Failed, or nothing to return (a pruned point): last in the objective's direction, which is
    # what Optuna reads (float) and what Nevergrad minimises (the value times -1 when maximising).
    failed, pruned = point_return(TPS, None, ok=False), point_return("loss/global_avg", None)
    assert float(failed) == -math.inf and not failed.ok and -1 * failed == math.inf
    assert float(pruned) == math.inf and pruned.ok
    # Launchers that run the task in another process pickle what it returns.
    assert pickle.loads(pickle.dumps(failed)).ok is False


def test_an_optimising_sweeper_must_go_the_objectives_way():
    check_sweeper("loss/global_avg", _sweeper("hydra/sweeper=optuna"))  # both minimise: Optuna's default
    check_sweeper(TPS, _sweeper("hydra/sweeper=optuna", "hydra.sweeper.direction=maximize"))
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.direction=maximize: sweep.objective=loss/global_avg is mi"):
        check_sweeper("loss/global_avg", _sweeper("hydra/sweeper=optuna", "hydra.sweeper.direction=maximize"))
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.direction=\['maximize', 'minimize'\]: .* one objective"):
        check_sweeper(TPS, _sweeper("hydra/sweeper=optuna", "hydra.sweeper.direction=[maximize,minimize]"))
    # Nevergrad's sweeper says it with optim.maximize (false by default).
    nevergrad = OmegaConf.create({"optim": {"maximize": False}})
    with pytest.raises(
        ConfigError, match=r"^hydra.sweeper.optim.maximize=false: .*; add hydra.sweeper.optim.maximize=true$"
    ):
        check_sweeper(TPS, nevergrad)
    # Hydra's basic sweeper reads no objective: any goes.
    check_sweeper(TPS, _sweeper())


def test_a_point_run_in_the_sweeps_own_process_returns_its_objective(tmp_path, store):
    """hydra/launcher=basic: the task itself (titan_exp/__main__.py) returns the objective, from the
    metrics the job hands back; the default, the loss, minimised (as Optuna does unless told otherwise)."""
    uri, db = store
    trials = [
        "hydra/launcher=basic",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=1",
        "optimizer.lr=choice(1e-3,1e30)",
    ]
    result = run_cli([*TRIALS, uri, *OPTUNA, "hydra/launcher=basic", *trials], tmp_path, flags=("-m",))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    [parent] = mlflow_runs(db, sweeps=True)
    children = {float(run.data.params["optimizer.lr"]): run for run in mlflow_runs(db)}
    assert {run.data.tags["mlflow.parentRunId"] for run in children.values()} == {parent.info.run_id}
    assert children[1e30].info.status == "FAILED"
    best = OmegaConf.load(tmp_path / "multirun" / "optimization_results.yaml")
    assert best.best_value == children[1e-3].data.metrics["loss/global_avg"]


def test_a_study_of_the_batch_keeps_each_trials_batch():
    """An optimising sweeper searching the batch (on the command line or in its params) compares
    batches: its trials are not held to the first one's tokens per step (job/held_batch.py)."""
    from hydra_plugins.titan_exp_launcher.titan_exp_launcher import _searched
    from titan_exp.job.held_batch import BATCH_KEYS

    def study(task: list[str], params: dict) -> set[str]:
        return _searched(OmegaConf.create({"hydra": {"sweeper": {"params": params}, "overrides": {"task": task}}}))

    assert study(["training.local_batch_size=choice(2,4,8)", "training.steps=3"], {}) & set(BATCH_KEYS)
    assert study([], {"training.global_batch_size": "choice(8,16)"}) & set(BATCH_KEYS)
    assert not study(["optimizer.lr=choice(1e-3,3e-3)", "training.local_batch_size=2"], {}) & set(BATCH_KEYS)

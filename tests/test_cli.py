"""The command line as a user meets it: printing the config, a run's step lines, refusing bad configs
up front, and a sweep going on past a point that fails (a run whose gradients stop being finite
fails naming the step: test_sweep_objective.py's study)."""

import os
import re
import subprocess
import sys

import pytest

from conftest import SMALL_MODEL, loss_curve, mlflow_runs, run_cli


def test_cfg_job_prints_the_composed_config_without_training(tmp_path, new_store):
    uri, db = new_store
    result = run_cli(["model=llama3_8b", "parallelism=fsdp", uri], tmp_path, flags=("--cfg", "job"))
    assert result.returncode == 0, result.stderr
    assert "flavor: 8b" in result.stdout and "data_parallel_shard_degree: -1" in result.stdout
    # No step was trained (no step lines) and nothing was tracked.
    assert not re.search(r"^step\s+\d", result.stdout, re.M) and "MLflow run" not in result.stdout
    assert not db.exists()


def test_a_runs_step_lines_say_where_it_stands_and_the_time_left(tmp_path):
    """Each logged step: N of all, and the time left at the pace since the first step, which has
    none yet, as the last has nothing left; a log (this pipe) gets plain lines, nothing redrawn."""
    overrides = ["parallelism=single", "tracking=none", *SMALL_MODEL, "training.steps=4", "metrics.log_freq=1"]
    result = run_cli(overrides, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if re.match(r"step +\d+/", line)]
    assert [line.split()[1] for line in lines] == ["1/4", "2/4", "3/4", "4/4"], result.stdout
    assert [bool(re.search(r"  ~\d+ s left$", line)) for line in lines] == [False, True, True, False], lines
    assert "\r" not in result.stdout and "\x1b" not in result.stdout


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["training.steps=0"], "training.steps=0: must be > 0"),
        (["training.seq_len=100000"], "training.seq_len=100000: exceeds model max_seq_len=2048"),
        (
            ["launcher.nproc_per_node=2", "parallelism.data_parallel_shard_degree=4"],
            "parallelism=dp_shard=4: the degrees multiply to 4 but the world size is 2",
        ),
        (
            [
                "parallelism.tensor_parallel_degree=5",
                "launcher.nproc_per_node=5",
                "parallelism.data_parallel_shard_degree=1",
            ],
            "must divide model n_heads=16",
        ),
    ],
)
def test_semantic_errors_exit_2_with_one_line_and_nothing_tracked(tmp_path, new_store, overrides, expected):
    uri, db = new_store
    result = run_cli([*overrides, uri, "launcher.device=cpu"], tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not db.exists()
    assert not (tmp_path / "run").exists()  # no run folder either: not even Hydra's .hydra/ and log


@pytest.mark.parametrize(
    "override,expected",
    [
        ("model=llama3_7b", "Could not find 'model/llama3_7b'"),
        ("training.foo=1", "Key 'foo' not in 'TrainingConfig'"),
        ("training.steps=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
    ],
)
def test_hydra_composition_errors_exit_2_in_one_line(tmp_path, new_store, override, expected):
    uri, db = new_store
    result = run_cli([override, uri], tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not db.exists()


def test_sweep_with_a_bad_point_is_refused_before_any_point_starts(tmp_path, new_store):
    uri, db = new_store
    result = run_cli(
        ["experiment=smoke", "tracking=mlflow", uri, "launcher.device=cpu", "training.steps=3,0"],
        tmp_path,
        flags=("-m",),
    )
    assert result.returncode == 2
    said = "titan_exp: config error: training.steps=0: must be > 0 (sweep point [1]: training.steps=0)"
    assert result.stderr.strip().splitlines() == [said]
    # Nothing ran (no point has a folder) and nothing was recorded.
    assert not db.exists() and not [p for p in (tmp_path / "multirun").glob("*") if p.is_dir()]


def test_sweep_goes_on_past_a_point_that_fails_at_run_time(tmp_path, store):
    uri, db = store
    from titan_exp.checkpoint.model_record import write_model_record
    from titan_exp.config.compose import compose_job_config

    corrupt = tmp_path / "corrupt" / "step-0"  # passes the config check (its model's), fails when loaded
    corrupt.mkdir(parents=True)
    (corrupt / ".metadata").write_bytes(b"not a checkpoint")
    write_model_record(corrupt, compose_job_config(["experiment=smoke", *SMALL_MODEL]).model, data_position=False)
    points = f"checkpoint.initial_load_path={corrupt},null"
    result = run_cli(
        ["experiment=smoke", "tracking=mlflow", uri, "launcher.device=cpu", "parallelism=single", *SMALL_MODEL, points],
        tmp_path,
        flags=("-m",),
    )
    assert result.returncode == 1
    assert "1 sweep point(s) failed" in result.stderr
    # One line per point: the failed one with its reason, the other ran to its last step.
    unreadable = rf"^\[0\] checkpoint.initial_load_path={corrupt}: failed \(.*is not a readable checkpoint"
    assert re.search(unreadable, result.stdout, re.M)
    assert re.search(r"^\[1\] checkpoint.initial_load_path=null: done \(step 6, loss [\d.]+\)$", result.stdout, re.M)
    # One rank each: the points ran side by side, either may have started first.
    runs = {run.data.params["checkpoint.initial_load_path"]: run for run in mlflow_runs(db)}
    failed, finished = runs[str(corrupt)], runs["None"]
    assert (failed.info.status, finished.info.status) == ("FAILED", "FINISHED")
    # The sweep's parent run says that a point failed.
    [parent] = mlflow_runs(db, sweeps=True)
    assert {run.data.tags["mlflow.parentRunId"] for run in (failed, finished)} == {parent.info.run_id}
    assert parent.info.status == "FAILED" and parent.data.tags["failure_reason"] == "1 sweep point(s) failed"


@pytest.mark.parametrize(
    "sweep,said",
    [
        (["training.steps=3,3"], "these points are the same job; drop one of them"),
        (["training.steps=range(1,10)", "launcher.max_sweep_points=8"], "the sweep has 9 points"),
    ],
    ids=["duplicate", "above_the_cap"],
)
def test_a_sweep_with_a_duplicate_or_too_many_points_starts_nothing(tmp_path, new_store, sweep, said):
    uri, db = new_store
    result = run_cli([*sweep, uri, "launcher.device=cpu"], tmp_path, flags=("-m",))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], result.stderr
    assert not db.exists() and not (tmp_path / "multirun").exists()  # nor Hydra's multirun.yaml


@pytest.mark.slow  # a 2-point sweep; by default: a grid's batches (test_plan.py), a sweep's (test_tracking.py)
def test_a_sweep_over_layouts_trains_every_point_on_the_same_tokens_per_step(tmp_path, store):
    """`local_batch_size` is per data-parallel rank: tp2 beside fsdp2 would train half the sequences a
    step. The sweep holds the first point's tokens per step (job/held_batch.py), says so, and tp2
    accumulates two microbatches to train them: the same data, so the same losses."""
    uri, db = store
    result = run_cli(
        ["tracking=mlflow", uri, "launcher.device=cpu", "parallelism=fsdp,tp", "training.steps=3", *SMALL_MODEL],
        tmp_path,
        flags=("-m",),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every point trains 2,048 tokens a step" in result.stdout
    assert re.search(
        r"parallelism=tp: global batch 8 = local batch 4 × 1 data-parallel ranks × accumulation 2", result.stdout
    )
    runs = {run.data.tags["layout"]: run for run in mlflow_runs(db)}
    assert {layout: run.data.params["derived/global_batch_tokens"] for layout, run in runs.items()} == {
        "fsdp2": "2048",
        "tp2": "2048",
    }
    assert runs["tp2"].data.params["derived/gradient_accumulation_steps"] == "2"
    fsdp, tp = (loss_curve(db, runs[layout].info.run_id) for layout in ("fsdp2", "tp2"))
    assert fsdp and len(fsdp) == len(tp) and all(abs(a - b) < 1e-4 for a, b in zip(fsdp, tp)), (fsdp, tp)


def test_a_reader_that_stops_early_ends_show_and_help_quietly(tmp_path):
    """`titan_exp show | head`: no BrokenPipeError traceback, the status of a process SIGPIPE ended."""
    for command in ("titan_exp show | head -1", "titan_exp --help | head -1"):
        done = subprocess.run(
            ["bash", "-c", f"{command}; echo status ${{PIPESTATUS[0]}} >&2"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert done.stdout.count("\n") == 1 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
        assert done.stderr.strip().splitlines()[-1] in ("status 0", "status 141"), done.stderr


def test_matplotlibs_first_use_says_nothing_in_a_runs_console(tmp_path):
    """Its font cache, built on first use, is logged at INFO: a job's console (Hydra logs INFO) stays clean."""
    code = "import logging; logging.basicConfig(level=logging.INFO); from titan_exp.pyplot import pyplot; pyplot()"
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "fresh")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "fontManager" not in done.stdout + done.stderr, done.stderr
    assert (tmp_path / "fresh").is_dir()  # the cache was built, quietly

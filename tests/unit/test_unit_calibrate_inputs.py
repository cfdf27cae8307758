"""Issue 68: `plan calibrate` reads a store as someone else's data (plan/stored_runs.py), in this
process against a real SQLite MLflow store. A run whose overrides would steer the composition
(Hydra's keys, + and ~, interpolation), are too many, too large, not YAML data, missing, a FIFO,
or do not compose, or whose TPS is NaN, infinite or not > 0, is skipped with one line naming it
(refused where --runs names it): never fitted, never a traceback. --name is one file name."""

import os
from pathlib import Path

import pytest
import yaml

from titan_exp import metric_names as names
from titan_exp.estimate.user_profiles import read_profile
from titan_exp.plan import calibrate_cli
from titan_exp.plan.stored_runs import OVERRIDES_ARTIFACT
from titan_exp.tracking.run import DEVICE_PROFILE_PARAM

from conftest import mlflow_client

GOOD = "- model=llama3_debug\n- parallelism={layout}\n- launcher.nproc_per_node=2\n"
LAUGHS = "- &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"- &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")
)

# What a crafted run holds (its overrides file, or its TPS) and what its line says.
CRAFTED = {
    "hydra.run.dir=/etc": ({}, "- hydra.run.dir=/etc\n", "sets hydra.run.dir, which is not a key or group"),
    "hydra/launcher=basic": ({}, "- hydra/launcher=basic\n", "sets hydra/launcher, which is not a key or group"),
    "+launcher=slurm": ({}, "- +launcher=slurm\n", "adds, removes, moves or sweeps"),
    "~model": ({}, "- ~model\n", "adds, removes, moves or sweeps"),
    "++training.x=1": ({}, "- ++training.x=1\n", "adds, removes, moves or sweeps"),
    "model@foo=llama3_8b": ({}, "- model@foo=llama3_8b\n", "adds, removes, moves or sweeps"),
    "a sweep": ({}, "- parallelism=ddp,fsdp\n", "adds, removes, moves or sweeps"),
    "${oc.env:HOME}": ({}, "- training.steps=${oc.env:HOME}\n", "interpolates (${...})"),
    "not an override": ({}, "- 'training.steps=[['\n", "is not an override"),
    "a table": ({}, "model: llama3_debug\n", "is not a list of overrides"),
    "1,001 overrides": ({}, "- training.steps=5\n" * 1001, "holds 1,001 overrides, more than 1,000"),
    "1.5M lines": ({}, "- training.steps=5\n" * 1_500_000, "more than the 262,144 such a file may be"),
    "billion laughs": ({}, LAUGHS, "uses YAML anchors or aliases"),
    "a Python tag": ({}, "- !!python/object/apply:os.system 'true'\n", "could not determine a constructor"),
    "not UTF-8": ({}, b"- model=caf\xe9\n", "is not UTF-8 text"),
    "missing": ({}, None, "cannot be read (No such file or directory)"),
    "a FIFO": ({}, "FIFO", "overrides.yaml is a FIFO, not a regular file"),
    "an unknown option": (
        {},
        "- model=nope\n",
        "its overrides make no job here (In 'config': Could not find 'model/nope'",
    ),
    "steps=abc": ({}, "- training.steps=abc\n", "its overrides make no job here"),
    "TPS nan": ({"tps": float("nan")}, GOOD, "throughput/tps_per_device_mean=nan, not in (0, 1e+09]"),
    "TPS inf": ({"tps": float("inf")}, GOOD, "throughput/tps_per_device_mean=1.79769e+308, not in (0, 1e+09]"),
    "TPS 0": ({"tps": 0.0}, GOOD, "throughput/tps_per_device_mean=0, not in (0, 1e+09]"),
    "TPS -5": ({"tps": -5.0}, GOOD, "throughput/tps_per_device_mean=-5, not in (0, 1e+09]"),
    "memory nan": ({"memory": float("nan")}, GOOD, "memory/max_reserved_gib=nan, not in (0, 1e+07]"),
}


@pytest.fixture
def tracked(store, tmp_path, monkeypatch):
    """tracked(name, overrides, tps=, memory=): a finished h100 run in the store, its overrides file
    written as given (bytes as they are, None: none, "FIFO": a FIFO); its id."""
    monkeypatch.setenv("TITAN_EXP_CONFIG_DIR", str(tmp_path / "conf"))
    client = mlflow_client(store[1])
    experiment = client.create_experiment("titan_exp", artifact_location=(tmp_path / "artifacts").as_uri())

    def track(name: str, overrides, tps: float = 1000.0, memory: float | None = None) -> str:
        run = client.create_run(experiment, run_name=name)
        run_id = run.info.run_id
        client.log_param(run_id, DEVICE_PROFILE_PARAM, "h100")
        client.log_metric(run_id, names.TPS_MEAN, tps, step=10)
        if memory is not None:
            client.log_metric(run_id, names.MAX_RESERVED_GIB, memory, step=10)
        path = Path(run.info.artifact_uri.removeprefix("file://")) / OVERRIDES_ARTIFACT
        path.parent.mkdir(parents=True)
        if overrides == "FIFO":
            os.mkfifo(path)
        elif isinstance(overrides, bytes):
            path.write_bytes(overrides)
        elif overrides is not None:
            path.write_text(overrides.replace("{layout}", name))
        client.set_terminated(run_id, "FINISHED")
        return run_id

    return track


def calibrate(capsys, store, *args: str) -> tuple[int, str, list[str]]:
    """`plan calibrate --hardware h100 ARGS` on the store: its status, stdout and stderr's lines."""
    status = calibrate_cli.main(["--hardware", "h100", "--uri", f"sqlite:///{store[1]}", *args])
    out, err = capsys.readouterr()
    return status, out, err.splitlines()


@pytest.mark.parametrize("case", CRAFTED, ids=list(CRAFTED))
def test_a_crafted_run_is_skipped_in_one_line_naming_it_and_never_fitted(case, tracked, store, tmp_path, capsys):
    metrics, overrides, says = CRAFTED[case]
    tracked("ddp", GOOD), tracked("fsdp", GOOD)
    crafted = tracked("tp", overrides, **metrics)
    status, out, err = calibrate(capsys, store, "--out", str(tmp_path / "fit.yaml"))
    skipped, refused = err  # the crafted run, said; then too few runs are left to fit on
    assert skipped.startswith(f"titan_exp plan calibrate: skipped run {crafted}: ") and says in skipped, skipped
    assert "2 finished run(s) with a measured TPS to fit on" in refused and status == 2
    assert out == "" and not (tmp_path / "fit.yaml").exists()


@pytest.mark.parametrize("case", ["hydra.run.dir=/etc", "TPS inf", "a FIFO"])
def test_a_crafted_run_named_with_runs_refuses_the_calibration_in_one_line(case, tracked, store, tmp_path, capsys):
    metrics, overrides, says = CRAFTED[case]
    runs = [tracked("ddp", GOOD), tracked("fsdp", GOOD), tracked("tp", overrides, **metrics)]
    status, out, err = calibrate(capsys, store, "--runs", ",".join(runs), "--out", str(tmp_path / "fit.yaml"))
    assert status == 2 and len(err) == 1 and err[0].startswith(f"titan_exp plan calibrate: run {runs[2]}: ")
    assert says in err[0] and out == "" and not (tmp_path / "fit.yaml").exists()


def test_the_good_runs_are_fitted_beside_a_skipped_one_and_the_profile_reads_back(tracked, store, tmp_path, capsys):
    """Three good runs and one whose overrides would move the run folder: the fit takes the three;
    the profile it writes in the user's folder is one the profile reader accepts."""
    for layout in ("ddp", "fsdp", "tp"):
        tracked(layout, GOOD, memory=30.0)
    crafted = tracked("evil", "- hydra.run.dir=/etc\n- model=llama3_debug\n")
    status, out, err = calibrate(capsys, store, "--name", "h100_ours")
    assert status == 0, err
    assert len(err) == 1 and err[0].startswith(f"titan_exp plan calibrate: skipped run {crafted}: ")
    assert out.count("| fitted on |") == 3 and "evil" not in out
    written = tmp_path / "conf" / "hardware" / "h100_ours.yaml"
    assert read_profile(written)["name"] == "h100_ours"
    assert yaml.safe_load(written.read_text())["device"] == "cuda"


NOT_ONE_FILE_NAME = "a profile's name is 1-100 letters, digits, _ . or - (one file name, not starting with .)"


@pytest.mark.parametrize(
    "name, says",
    [
        ("../../x", NOT_ONE_FILE_NAME),
        ("a/b", NOT_ONE_FILE_NAME),
        (".hidden", NOT_ONE_FILE_NAME),
        ("x" * 101, NOT_ONE_FILE_NAME),
        ("h100", "a profile shipped with titan_exp has that name"),
    ],
    ids=["../../x", "a/b", ".hidden", "101 characters", "h100"],
)
def test_a_name_that_is_not_one_file_name_of_its_own_is_refused_and_nothing_written(
    name, says, tracked, store, tmp_path, capsys
):
    for layout in ("ddp", "fsdp", "tp"):
        tracked(layout, GOOD)
    status, out, err = calibrate(capsys, store, "--name", name)
    assert status == 2 and len(err) == 1 and err[0].startswith("titan_exp plan calibrate: --name=") and says in err[0]
    assert out == "" and not (tmp_path / "x.yaml").exists() and not (tmp_path / "conf").exists()


def test_a_profile_file_that_is_a_link_is_replaced_not_written_through(tracked, store, tmp_path, capsys):
    for layout in ("ddp", "fsdp", "tp"):
        tracked(layout, GOOD)
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    (tmp_path / "fit.yaml").symlink_to(precious)
    status, _, err = calibrate(capsys, store, "--out", str(tmp_path / "fit.yaml"))
    assert status == 0, err
    assert precious.read_text() == "keep me\n" and not (tmp_path / "fit.yaml").is_symlink()


def test_an_unknown_hardware_is_refused_in_one_line(store, capsys):
    status, _, err = calibrate(capsys, store, "--hardware", "h100 hydra.run.dir=/etc")
    assert status == 2 and len(err) == 1 and "--hardware='h100 hydra.run.dir=/etc': no such profile" in err[0]

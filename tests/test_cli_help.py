"""What a new user meets first: the installed command, its help page, tab completion, the resolved
job shown before anything runs, and labels that are not choices."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from titan_exp import CONF_DIR
from titan_exp.config.schema import JobConfig
from titan_exp.config.tree import group_options
from titan_exp.help_page import MOST_USED, field_docs

from conftest import REPO, run_cli


def titan_exp(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed console script, as a user types it."""
    command = shutil.which("titan_exp")
    assert command is not None, "./setup.sh installs the titan_exp command"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([command, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=120)


def test_the_help_page_is_the_projects_own(tmp_path):
    result = titan_exp(["--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    page = result.stdout
    assert "powered by Hydra" not in page
    for subcommand in ("show", "plan", "compare", "ui", "sync", "export"):
        assert f"titan_exp {subcommand} " in page
    for group, options in group_options().items():  # every group with every option
        line = next(line for line in page.splitlines() if line.strip().startswith(group + " "))
        assert all(option in line for option in options), line
    assert "llama3_debug*" in page and "fsdp*" in page  # config.yaml's defaults are marked
    for key in MOST_USED:
        assert f"  {key} " in page, key
    # A key's line is its field's comment in the schema (written once, beside the code).
    assert "Ranks that shard each parameter, gradient and optimizer state" in page
    assert not list(tmp_path.iterdir())  # --help writes no run folder


def test_every_most_used_key_has_a_line_of_its_own():
    sections = {f.name: f.default_factory for f in JobConfig.__dataclass_fields__.values()}
    for key in MOST_USED:
        section, name = key.split(".")
        assert field_docs(sections[section]).get(name), f"{key}: write a comment above its field"


@pytest.mark.parametrize("subcommand", ["show", "plan", "compare", "ui", "sync", "export"])
def test_each_subcommand_has_its_help(tmp_path, subcommand):
    result = titan_exp([subcommand, "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: titan_exp {subcommand}")


def test_tab_completion_offers_subcommands_groups_options_and_keys(tmp_path):
    def complete(line: str) -> list[str]:
        result = titan_exp(["-sc", "query=bash"], tmp_path, env={"COMP_LINE": line})
        assert result.returncode == 0, result.stderr
        return result.stdout.split()

    first = complete("titan_exp ")
    assert {"show", "plan", "compare", "ui", "sync", "export", "model=", "training."} <= set(first)
    assert complete("titan_exp pl") == ["plan", "plan."]
    assert set(complete("titan_exp model=")) == {f"model={option}" for option in group_options()["model"]}
    assert "training.steps=" in complete("titan_exp training.st")
    # The script Hydra prints registers a completion function for the command.
    script = titan_exp(["-sc", "install=bash"], tmp_path).stdout
    registered = subprocess.run(["bash", "-c", f"{script}\ncomplete -p titan_exp"], capture_output=True, text=True)
    assert "hydra_bash_completion" in registered.stdout, registered.stderr


def test_show_prints_the_resolved_job_and_starts_nothing(tmp_path):
    result = titan_exp(
        ["show", "parallelism=hsdp", "launcher.nproc_per_node=4", "launcher.oversubscribe=true",
         "parallelism.data_parallel_replicate_degree=2", "training.global_batch_size=32"],
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "pp 1 × dp_replicate 2 × dp_shard 2 × cp 1 × tp 1 = world 4: hsdp2x2" in out
    assert "1 node(s) × 4 on cpu" in out
    assert "32 sequences = 4 × dp 4 × 2 microbatch(es)" in out  # the accumulation worked out
    assert "nproc_per_node: 4" in out and "data_parallel_shard_degree: 2" in out  # no -1 left
    assert "  folder: <job folder>/checkpoints\n" in out  # where a run of it would keep its checkpoints
    assert not list(tmp_path.iterdir())


def test_show_refuses_what_a_run_refuses_in_one_line(tmp_path):
    result = titan_exp(["show", "parallelism.tensor_parallel_degree=3"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "parallelism" in result.stderr


@pytest.mark.parametrize("override", ["model.flavor=8b", "model.name=llama4", "parallelism.name=fsdp_tp"])
def test_a_key_that_only_labels_is_not_a_choice(tmp_path, new_store, override):
    uri, db = new_store
    result = run_cli([override, uri], tmp_path)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert override in line and "only labels the run" in line and "llama3_8b" in line or "fsdp_tp" in line
    assert not db.exists() and not (tmp_path / "run").exists()


def test_a_sweep_over_a_label_is_refused_before_any_point_starts(tmp_path, new_store):
    uri, db = new_store
    result = run_cli(["model.flavor=a,b", uri], tmp_path, flags=("-m",))
    assert result.returncode == 2 and "only labels the run" in result.stderr
    assert not db.exists()


def test_pip_install_dot_ships_the_config_tree(tmp_path):
    """A non-editable install (into a folder, so this environment's install stays): its command
    composes from the packaged titan_exp/conf."""
    target, source = tmp_path / "site", tmp_path / "source"
    # From a copy: setuptools builds in the source's build/, whose leftovers would ship too.
    left_out = shutil.ignore_patterns(".git", "outputs", "build", "*.egg-info", "__pycache__")
    shutil.copytree(REPO, source, ignore=left_out)
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    shipped = {p.relative_to(target / "titan_exp") for p in (target / "titan_exp" / "conf").rglob("*.yaml")}
    assert shipped == {p.relative_to(CONF_DIR.parent) for p in CONF_DIR.rglob("*.yaml")}
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run(
        [str(target / "bin" / "titan_exp"), "--cfg", "job", "model=llama3_8b"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "flavor: 8b" in result.stdout
    where = subprocess.run(
        [sys.executable, "-c", "import titan_exp; print(titan_exp.CONF_DIR)"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert where.stdout.strip() == str((target / "titan_exp" / "conf").resolve())

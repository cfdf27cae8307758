"""No warning on the console of a short default run (its ranks' included: checked on
test_architecture.py's default run, whose launching side loads no torch), nor of the dry runs of the
layouts that gave one (fsdp_cp and HSDP with cp sliced a flattened dim back out of the root mesh;
fsdp_tp's embeddings return a view). What a dependency says that the project cannot avoid is ignored
in titan_exp/dependency_warnings.py, narrowly; anything else shows, and fails here."""

import re

import pytest

from conftest import run_cli

WARNING = re.compile(r"\w*Warning\b")


def warning_lines(*consoles: str) -> list[str]:
    return [line for console in consoles for line in console.splitlines() if WARNING.search(line)]


# The dry run's own world of 8; HSDP with cp=2 is 2 x 2 x cp 2.
DRY_RUN = ["debug.comm_mode=fake_backend", "launcher.nproc_per_node=8", "tracking=none"]


@pytest.mark.parametrize("layout", ["fsdp_tp", "fsdp_cp", "hsdp parallelism.context_parallel_degree=2"])
def test_dry_runs_of_the_layouts_that_warned_say_none(tmp_path, layout):
    result = run_cli([*DRY_RUN, *f"parallelism={layout}".split()], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dry run" in result.stdout and warning_lines(result.stdout, result.stderr) == []

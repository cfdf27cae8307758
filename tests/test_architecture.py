"""The layering rules (docs/design.md), checked on the code as it is: imports point one way (no
package imports one that imports it back), launchers/ knows nothing of titan_exp, the launching side
never imports the rank side, and the launching process never loads torch (start-up time: only the
ranks and the dry runs do); and the size limits every module, function and signature keeps."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from test_warnings import warning_lines

from conftest import REPO, assert_startup_adds_up, mlflow_runs, run_cli

PACKAGES = ("titan_exp", "launchers")


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function, as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _unit(module: str) -> str | None:
    """The unit the layering rules speak of: a sub-package of titan_exp (titan_exp.tracking) or a
    module at its top (titan_exp.ui), or launchers as a whole; None outside the project."""
    parts = module.split(".")
    if parts[0] == "launchers":
        return "launchers"
    if parts[0] != "titan_exp" or len(parts) < 2:
        return None
    return f"titan_exp.{parts[1]}"


def _unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            source = _unit(module)
            if source is None:  # titan_exp/__init__.py
                continue
            targets = {_unit(name) for name in _imports(path)} - {None, source}
            graph.setdefault(source, set()).update(targets)
    return graph


def test_nothing_outside_its_folder_names_a_model_family():
    """A family is its folder under models/ (and its option YAMLs): the rest reads the registry."""
    from titan_exp.models.registry import FAMILIES

    named = [
        f"{path.relative_to(REPO)}: {family}"
        for path in (REPO / "titan_exp").rglob("*.py")
        if "models" not in path.relative_to(REPO / "titan_exp").parts
        for family in FAMILIES
        if family in path.read_text()
    ]
    assert FAMILIES and named == []


def test_no_launcher_is_named_outside_launchers():
    """An engine is its module in launchers/ (and its option YAML): titan_exp never branches on one."""
    from launchers.registry import LAUNCHERS

    named = [
        f"{path.relative_to(REPO)}: {engine}"
        for path in (REPO / "titan_exp").rglob("*.py")
        for engine in LAUNCHERS
        for quote in "\"'"
        if f"{quote}{engine}{quote}" in path.read_text()
    ]
    assert len(LAUNCHERS) >= 2 and named == []


def test_imports_point_one_way():
    graph = _unit_graph()
    assert {
        "titan_exp.config",
        "titan_exp.job",
        "titan_exp.rank",
        "titan_exp.train",
        "titan_exp.tracking",
        "launchers",
    } <= set(graph)
    both_ways = sorted((a, b) for a, targets in graph.items() for b in targets if a < b and a in graph.get(b, set()))
    assert both_ways == [], f"these import each other: {both_ways}"
    # No longer loops either (a → b → c → a): walk the graph depth-first.
    state: dict[str, str] = {}

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = "open"
        for target in sorted(graph.get(unit, ())):
            assert state.get(target) != "open", f"import cycle: {' → '.join([*path, unit, target])}"
            if target not in state:
                visit(target, [*path, unit])
        state[unit] = "done"

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [])


def test_launchers_import_nothing_from_titan_exp():
    assert "launchers" in _unit_graph()
    assert not any(t.startswith("titan_exp") for t in _unit_graph()["launchers"])
    # And at run time: importing every launcher module loads no titan_exp module.
    modules = [".".join(p.relative_to(REPO).with_suffix("").parts) for p in (REPO / "launchers").glob("*.py")]
    loaded = "sorted(m for m in sys.modules if m.startswith('titan_exp'))"
    code = f"import sys; [__import__(m) for m in {modules!r}]; print({loaded})"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# The launching side (job placement, sweeps, the command line) and the rank side (what each rank runs).
LAUNCHING_SIDE = ("titan_exp.job", "titan_exp.__main__", "hydra_plugins")
RANK_SIDE = ("titan_exp.rank", "titan_exp.train")


def test_the_launching_side_names_the_rank_side_but_never_imports_it():
    for package in ("titan_exp/job", "titan_exp/__main__.py", "hydra_plugins"):
        for path in (REPO / package).rglob("*.py") if (REPO / package).is_dir() else [REPO / package]:
            imported = {name for name in _imports(path) if name.startswith(RANK_SIDE)}
            assert not imported, f"{path.relative_to(REPO)} imports the rank side: {sorted(imported)}"
    assert (REPO / "titan_exp/rank/entry.py").exists() and (REPO / "titan_exp/job/launch.py").exists()


def test_tracking_does_not_know_jobs_or_comparisons():
    graph = _unit_graph()
    assert not graph["titan_exp.tracking"] & {
        "titan_exp.compare",
        "titan_exp.job",
        "titan_exp.config",
        "titan_exp.train",
    }


# Runs the command line in this process, then reports which of these modules it loaded.
_PROBE = """
import atexit, runpy, sys
atexit.register(lambda: print("LOADED", sorted(m for m in ("torch", "mlflow") if m in sys.modules), file=sys.stderr))
sys.argv = sys.argv[1:]  # ["titan_exp", overrides...]
runpy.run_module("titan_exp", run_name="__main__")
"""


def _loaded_by_launching_process(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("LOADED"))


def test_printing_the_config_loads_no_torch(tmp_path):
    result = run_cli(["model=llama3_8b"], tmp_path, flags=("--cfg", "job"), launcher=[sys.executable, "-c", _PROBE])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "flavor: 8b" in result.stdout
    assert _loaded_by_launching_process(result.stderr) == "LOADED []"


def test_the_launching_side_of_a_short_default_run_loads_no_torch_and_no_console_warns(tmp_path, new_store):
    uri, db = new_store
    result = run_cli(["training.steps=2", uri], tmp_path, launcher=[sys.executable, "-c", _PROBE])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step     2" in result.stdout  # the ranks trained (with torch, in their own processes)
    # A new store is created by the launching process (MLflow); torch stays out.
    assert _loaded_by_launching_process(result.stderr) == "LOADED ['mlflow']"
    assert db.exists()
    # Where the start-up went, from the command's start: printed after the first step, and metrics.
    assert "start-up:" in result.stdout
    [run] = mlflow_runs(db)
    assert_startup_adds_up(run, ("python_imports", "compose", "store", "spawn", "rank_imports", "torch_import"))
    # No warning on its console, nor on each rank's (their stdout and stderr, where the launcher
    # keeps them): test_warnings.py.
    ranks = [log.read_text() for log in (tmp_path / "run" / "ranks").glob("*_log.*")]
    assert len(ranks) >= 2
    assert warning_lines(result.stdout, result.stderr, *ranks) == []


# Outside the tests: no module over 400 lines, no function over 60, no signature over 7 parameters
# (self and cls not counted).
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS = 400, 60, 7


def _source_files() -> list[Path]:
    return [p for package in (*PACKAGES, "hydra_plugins", "benchmarks") for p in (REPO / package).rglob("*.py")]


def test_modules_functions_and_signatures_stay_small():
    too_big = []
    for path in _source_files():
        source = path.read_text()
        name = path.relative_to(REPO)
        if (lines := len(source.splitlines())) > MAX_MODULE_LINES:
            too_big.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                too_big.append(f"{name}:{node.lineno} {node.name}: {length} lines")
            args = node.args
            named = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
            count = len(named) + bool(args.vararg) + bool(args.kwarg) - (named[:1] in (["self"], ["cls"]))
            if count > MAX_PARAMETERS:
                too_big.append(f"{name}:{node.lineno} {node.name}: {count} parameters")
    assert too_big == []


@pytest.mark.parametrize("script", sorted(p.stem for p in (REPO / "benchmarks").glob("*.py")))
def test_every_benchmark_script_imports(script, monkeypatch):
    # No test runs them (they take minutes): a name one of them imports from another, and a later
    # change removed, would otherwise go unnoticed until someone runs it.
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    importlib.import_module(script)

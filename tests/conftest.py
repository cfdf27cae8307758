"""Shared helpers: compose configs like the CLI does, and run the CLI in a subprocess."""

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from titan_exp import CONF_DIR
from titan_exp.config.schema import register_schema

REPO = Path(__file__).resolve().parents[1]

register_schema()


# The modules that take longest, longest first: pytest-xdist hands modules out in collection order
# (pyproject.toml's addopts: --no-loadscope-reorder), and a long one handed out last would run alone
# at the end. Measured on 2 cores, the default suite's over 30 s, then the marked runs'.
LONGEST_MODULES = (
    # Marked only, and alone (the machine lock below): first, beside short tests (Ray's), so that it
    # waits for no long one of the other worker's (the README's, one test, took 8.6 minutes on
    # 2026-12-06); that worker waits ~5 minutes.
    "test_plan_calibrate.py",
    "test_ray.py",  # marked only: a Ray cluster and its jobs, about 4 minutes
    "test_readme.py",  # marked only: every README command, about 5 minutes
    "test_launcher.py",
    "test_parity.py",
    "test_moe.py",
    "test_tracking.py",
    "test_sweep_objective.py",
    "test_expert_parallel.py",
    "test_plan.py",
    "test_profiling.py",
    "test_hf_weights.py",
    "test_document_mask.py",
    "test_hf_qwen3.py",
    "test_dryrun.py",
    "test_cli.py",
    "test_ui.py",
    "test_data_files.py",
    "test_slurm.py",
    "test_slurm_two_nodes.py",
)


# Tests take the machine shared; a test that times the machine (marked `alone`) takes it whole: the
# other xdist worker waits before its next test instead of running ranks beside the measurements.
_MACHINE_LOCK = Path(tempfile.gettempdir()) / "titan_exp_tests.lock"


@pytest.fixture(autouse=True)
def _machine_share(request: pytest.FixtureRequest) -> Iterator[None]:
    alone = request.node.get_closest_marker("alone") is not None
    with open(_MACHINE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)

    items.sort(key=rank)  # stable: the rest keep their order


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def run_cli(
    args: list[str],
    tmp_path: Path,
    *,
    flags: tuple[str, ...] = (),
    timeout: int = 300,
    launcher: list[str] | None = None,
    env: dict | None = None,
):
    """`python -m titan_exp FLAGS OVERRIDES` with outputs under tmp_path; returns the CompletedProcess."""
    overrides = [f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/multirun", *args]
    command = (launcher or [sys.executable, "-m"]) + ["titan_exp", *flags, *overrides]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def subcommand(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m titan_exp <subcommand> ...` (no Hydra run folder: plan and compare write where told)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "titan_exp", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def new_store(tmp_path: Path) -> tuple[str, Path]:
    """Where a new SQLite MLflow store goes (the tracking.uri override and the database path): the
    job under test creates it, or, refused, must leave none."""
    db = tmp_path / "mlflow.db"
    return f"tracking.uri=sqlite:///{db}", db


@pytest.fixture(scope="session")
def migrated_store(tmp_path_factory) -> Path:
    """An empty SQLite store with MLflow's tables, made once per session (its migrations take seconds)."""
    db = tmp_path_factory.mktemp("migrated") / "mlflow.db"
    mlflow_client(db).search_experiments()  # MLflow creates the tables (and only its Default experiment)
    return db


@pytest.fixture
def store(tmp_path: Path, migrated_store: Path) -> tuple[str, Path]:
    """A SQLite MLflow store of the test's own, its tables made (a copy of the session's empty one),
    for tests whose subject is not the creation of a store: the tracking.uri override and the path."""
    return store_in(tmp_path, migrated_store)


def store_in(folder: Path, migrated_store: Path) -> tuple[str, Path]:
    """A copy of the migrated store in `folder`: the tracking.uri override and the path."""
    db = folder / "mlflow.db"
    shutil.copy(migrated_store, db)
    return f"tracking.uri=sqlite:///{db}", db


def mlflow_client(db: Path):
    """A client of the SQLite store at `db`."""
    from titan_exp.tracking.store import client

    return client(f"sqlite:///{db}")


def mlflow_runs(db: Path, *, sweeps: bool = False) -> list:
    """The training runs (sweeps=True: the sweeps' parent runs) of the titan_exp experiment in a SQLite
    store, oldest first."""
    client = mlflow_client(db)
    experiment = client.get_experiment_by_name("titan_exp")
    if experiment is None:  # no job has written to the store yet
        return []
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    return [run for run in runs if (run.data.tags.get("titan_exp.role") == "sweep") == sweeps]


def loss_curve(db: Path, run_id: str) -> list[float]:
    from titan_exp.compare.runs import loss_curve as steps_and_losses

    return [loss for _, loss in steps_and_losses(mlflow_client(db), run_id)]


def assert_bfloat16_export_gives_our_logits(step: Path, inputs) -> None:
    """A bfloat16 export (a checkpoint's step folder written with checkpoint.export_dtype=bfloat16)
    opens in transformers as bfloat16, and gives the logits of our model of the same step's DCP
    checkpoint with the export's rounding (both in float32)."""
    import torch
    import transformers

    from titan_exp.checkpoint.manager import load_model
    from titan_exp.models.registry import build_model, config_from_hf

    exported = transformers.AutoModelForCausalLM.from_pretrained(step)
    assert exported.dtype == torch.bfloat16
    ours = build_model(config_from_hf(str(step), "model.hf_path"))
    load_model(ours, str(step))
    with torch.no_grad():
        for param in ours.parameters():
            param.copy_(param.to(torch.bfloat16).float())
        torch.testing.assert_close(exported.float()(inputs).logits, ours(inputs), rtol=0, atol=1e-4)


def assert_startup_adds_up(run, phases: tuple[str, ...]) -> None:
    """The run logged where its start-up went: at least `phases`, adding up to the total."""
    logged = {k: v for k, v in run.data.metrics.items() if k.startswith("startup/")}
    total = logged.pop("startup/total_s")
    assert set(logged) >= {f"startup/{phase}_s" for phase in phases}, logged
    # Each phase is rounded to 1 ms; the rank process's creation is read from /proc in 10 ms ticks.
    assert sum(logged.values()) == pytest.approx(total, abs=0.02) and min(logged.values()) > -0.02


# A model 1/16 of llama3_debug (355 k parameters), for runs whose subject is not the model
# (launching, tracking, stopping, sweeping): the same code paths, a second less of CPU per job.
SMALL_MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16"]


# What a launcher (torchrun, srun, our own) may set in a rank's environment.
PLACEMENT_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@pytest.fixture
def placement_env():
    """No launcher's variables (nor COMM_MODE, OMP_NUM_THREADS) to start with; yields a setter. The
    whole environment is restored after the test (launchers.env.export writes straight into it), so
    later tests do not find themselves "under torchrun"."""
    saved = dict(os.environ)
    for key in [*PLACEMENT_VARIABLES, "COMM_MODE", "OMP_NUM_THREADS", *(k for k in saved if k.startswith("SLURM_"))]:
        os.environ.pop(key, None)
    yield lambda **values: os.environ.update({key: str(value) for key, value in values.items()})
    os.environ.clear()
    os.environ.update(saved)


def process_group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state not in ("Z", "X"):
            return True
    return False


def start_as_in_a_terminal(command: list[str], **popen) -> subprocess.Popen:
    """`command` from the repo in a session of its own with SIGINT at its default, as a shell's
    foreground job is (a Ctrl-C is then os.killpg(proc.pid, SIGINT))."""
    return subprocess.Popen(
        command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen,
    )  # fmt: skip


@contextlib.contextmanager
def stopped_for_good(proc: subprocess.Popen, stop) -> Iterator[None]:
    """Inside: wait for the moment to stop `proc`; on leaving, `stop(proc)`, its end awaited, and
    every process of its session gone within 10 s (asserted), or killed whatever happens."""
    try:
        yield
        stop(proc)
        proc.communicate(timeout=180)
        deadline = time.monotonic() + 10
        while process_group_alive(proc.pid):
            assert time.monotonic() < deadline, "processes of the stopped job are still running"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def start_mlflow_server(db: Path, port: int, log: Path) -> subprocess.Popen:
    """`titan_exp ui` (a real `mlflow server`) on 127.0.0.1:`port` over the SQLite store `db`, once it
    answers its health endpoint."""
    command = [sys.executable, "-m", "titan_exp", "ui", "--uri", f"sqlite:///{db}", "--port", str(port)]
    server = subprocess.Popen(
        command, cwd=REPO, stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                stop_mlflow_server(server)
                pytest.fail(f"mlflow server did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.5)


def stop_mlflow_server(server: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def chromium(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Debian's headless Chromium with `args` (a URL, --dump-dom, --screenshot=...), behind
    `prefix` (e.g. unshare --net, to take the network away)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail("Debian's chromium is not installed: ./setup.sh --test installs it")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--window-size=1400,900",
        "--virtual-time-budget=20000",
    ]
    return subprocess.run([*prefix, binary, *flags, *args], capture_output=True, text=True, timeout=180)


def processes_naming(name: Path | str) -> list[str]:
    """The command lines of live processes that name `name` (a test cluster's daemons name its folder)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(name) in command:
            found.append(command)
    return found


def wait_for_output(tmp_path: Path, pattern: str, timeout: float = 120.0) -> re.Match:
    """The first match of `pattern` in tmp_path/out.txt (a started command's output), waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, (tmp_path / "out.txt").read_text(), re.M)
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in: {(tmp_path / 'out.txt').read_text()[-3000:]}")

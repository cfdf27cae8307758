"""Bad inputs as a user (or a careless script) gives them, each run as a command from a fresh folder:
is each refused cleanly (exit 2, one line on stderr, no traceback, no store written, no run folder
left), within MEMORY_BOUND and TIME_BOUND_S? Prints a line per input (with its peak memory and
time) and the tally. The inputs are the probe's of issue 24 and more of their kind, then issue 47's
and 68's crafted files (tests/crafted.py: devices, FIFOs, headers that lie, config.json values of
the wrong type, float8 and MXFP4 scales, tokenizers, checkpoint folders with links), then stores
and device profiles; add yours.

    python benchmarks/probe_bad_inputs.py            # about 5 minutes on 2 cores
"""

import contextlib
import os
import resource
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from crafted import CASES, Case, files_data  # noqa: E402

# No case may take more (the launching process and anything it started, at its peak) ...
MEMORY_BOUND = 2 << 30
TIME_BOUND_S = 60
# ... and none may take the machine down trying: each command runs under this address-space limit.
_ADDRESS_SPACE = 8 << 30
# Each: the arguments of `python -m titan_exp`.
BAD_INPUTS = [
    *(
        [override]
        for override in (
            "model.norm_eps=nan",
            "model.rope_theta=0",
            "model.n_kv_heads=3",
            "model.dim=0",
            "model.n_heads=5",
            "model.ffn_dim_multiplier=-1",
            "model.n_heads=7",
            "model.n_kv_heads=0",
            "model.n_layers=0",
            "model.n_heads=0",
            "model.multiple_of=0",
            "model.vocab_size=-1",
            "model.max_seq_len=0",
            "compile.backend=nope",
            "debug.seed=-1",
            "launcher.cpu_threads_per_rank=0",
            "launcher.cpu_threads_per_rank=-5",
            "tracking.system_metrics_interval_s=0",
            "tracking.parent_run_id=0123abcd",
            "plan.memory_budget_gib=-1",
            "plan.memory_budget_gib=0",
            "plan.memory_margin=1.5",
            "hardware.matmul_efficiency=nan",
            "hardware.memory_gib=0",
            "training.steps=abc",
            "training.steps=0",
            "training.seq_len=-4",
            "training.max_norm=inf",
            "optimizer.lr=nan",
            "optimizer.beta1=2",
            "lr_scheduler.decay_ratio=1.5",
            "data.corpus_path=/dev/null",
            "data.corpus_path=/bin/ls",
            "data.corpus_path=EMPTY",
            "tracking.experiment=../../escaped",
            "tracking.experiment=/abs/exp",
            f"tracking.experiment={'x' * 300}",
            "tracking.uri=foo://x",
            "tracking.uri=http://alice:s3cret@127.0.0.1:9",
            "tracking.uri=sqlite:////proc/titan/m.db",
            "tracking.uri=sqlite:////dev/null",
            "tracking.uri=sqlite:///:memory:",
            f"tracking.run_name={'x' * 9000}",
            "tracking.run_name='red\x1b[31m'",
            "hydra.run.dir='a\nb'",
            "launcher.heartbeat_timeout_s=1",
            "comm.train_timeout_seconds=0",
            "launcher.nproc_per_node=64",
            "training.foo=1",
            "model=llama3_7b",
            "quantize=mxfp8",
            "parallelism.tensor_parallel_degree=3",
            "launcher=slurm",
        )
    ),
    ["parallelism=pp", "launcher.nproc_per_node=2", "parallelism.pipeline_parallel_layers_per_stage=0"],
    ["hardware=h100", "hardware.peak_tflops_bfloat16=0"],
    ["checkpoint.enable=true", "checkpoint.folder=/proc/x"],
    ["-m", "training.steps=3,3"],
    ["-m", "training.steps=range(1,100)"],
    ["-m", "training.steps=3,0"],
    ["-m", "checkpoint.enable=true", "checkpoint.folder=shared", "optimizer.lr=1e-3,2e-3"],
    ["-m", "tracking.uri=sqlite:///a.db,sqlite:///b.db"],
    ["plan", "calibrate", "--hardware", "h100", "--name", "../../x"],
    *(
        ["launcher=ray", "launcher.device=cpu", "launcher.nproc_per_node=2", "launcher.address=http://127.0.0.1:1", bad]
        for bad in (
            "+launcher.runtime_env.env_vars=3",
            "+launcher.runtime_env.pip=3",
            "+launcher.runtime_env.py_modules=[/nope]",
            "+launcher.runtime_env.bogus=1",
            "launcher.runtime_env=3",
            "launcher.address=foo://x",
            "launcher.address=ray://127.0.0.1:1",
        )
    ),
    ["ui", "--port=-1"],
    ["ui", "--port=99999"],
    ["ui", "--uri", "sqlite:///NOTES"],
    ["compare", "--uri", "sqlite:///NOTES"],
    ["plan", "quantize=mxfp8", "hardware=h100"],
    ["plan", "model.n_heads=7"],
]


def _one_line_of_200_mb(folder: Path) -> list[str]:
    """Issue 47's: the launcher alone grew to 6.8 GB reading and tokenizing it."""
    data = folder / "long.jsonl"
    with open(data, "w") as file:
        file.write('{"text": "' + "word " * (40 << 20) + '"}\n')
    return files_data(folder, data)


def _store_of_another_application(folder: Path) -> list[str]:
    """Issue 68's: MLflow wrote its tables into it."""
    with contextlib.closing(sqlite3.connect(folder / "notes.sqlite")) as db:
        db.execute("CREATE TABLE notes (text)")
        db.commit()
    return [f"tracking.uri=sqlite:///{folder}/notes.sqlite"]


def _store_a_fifo(folder: Path) -> list[str]:
    """Issue 68's: the launching process blocked in its open, deaf to SIGTERM, for 12 minutes."""
    os.mkfifo(folder / "fifo.db")
    return [f"tracking.uri=sqlite:///{folder}/fifo.db"]


def _profile(text: str | bytes, name: str = "mine") -> Callable[[Path], list[str]]:
    """A device profile in the config folder (TITAN_EXP_CONFIG_DIR is FOLDER/config for each case)."""

    def make(folder: Path) -> list[str]:
        (folder / "config" / "hardware").mkdir(parents=True)
        path = folder / "config" / "hardware" / f"{name}.yaml"
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return [f"hardware={name}", "training.steps=1"]

    return make


def _laughs(levels: int = 9) -> str:
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


# Here only: each writes 200 MB, or needs a file whose making the test suite checks otherwise
# (tests/unit/test_unit_crafted_inputs.py checks the bounds with less; the stores and profiles:
# tests/test_journal.py, tests/unit/test_unit_user_profiles.py).
PROBE_ONLY = [
    Case("data file: one line of 200 MB", _one_line_of_200_mb),
    Case("tracking.uri: another application's SQLite database", _store_of_another_application),
    Case("tracking.uri: a FIFO", _store_a_fifo),
    Case("profile: @package _global_", _profile("# @package _global_\nhydra: {run: {dir: /tmp/evil}}\n")),
    Case("profile: billion laughs", _profile(_laughs())),
    Case("profile: a Python tag", _profile("name: !!python/object/apply:os.system ['true']\n")),
    Case("profile: not UTF-8", _profile(b"name: caf\xe9\n")),
    Case("profile: peak_tflops_bfloat16: lots", _profile("peak_tflops_bfloat16: lots\n")),
    Case("profile: peak_tflops_bfloat16: 1e308", _profile("peak_tflops_bfloat16: 1e308\n")),
    Case("profile: memory_gib: 1e-300", _profile("memory_gib: 1e-300\n")),
    Case("profile: nics_per_node: 10**12", _profile("nics_per_node: 1000000000000\n")),
    Case("profile: devices_per_node: 0", _profile("devices_per_node: 0\n")),
    Case("profile: named like a shipped one", _profile("name: h100\n", name="h100")),
]


def _bounded() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, _ADDRESS_SPACE))
    os.setsid()  # its own group: a case past its time is killed whole


def run_bounded(command: list[str], folder: Path) -> tuple[int | None, str, str, int, float]:
    """(exit status, None if killed past TIME_BOUND_S; stdout; stderr; peak memory in bytes of the
    command and what it waited for; seconds)."""
    out, err = folder.parent / f"{folder.name}.out", folder.parent / f"{folder.name}.err"
    # Each case's own config folder (a profile's, or none): never the user's.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TITAN_EXP_CONFIG_DIR": str(folder / "config")}
    started = time.monotonic()
    with open(out, "w") as stdout, open(err, "w") as stderr:
        process = subprocess.Popen(command, cwd=folder, env=env, stdout=stdout, stderr=stderr, preexec_fn=_bounded)
    status = None
    while time.monotonic() - started < TIME_BOUND_S:
        pid, wait_status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            status = os.waitstatus_to_exitcode(wait_status)
            break
        time.sleep(0.05)
    else:
        os.killpg(process.pid, signal.SIGKILL)
        _, _, usage = os.wait4(process.pid, 0)
    process.returncode = status  # reaped here, not by Popen
    return status, out.read_text(), err.read_text(), usage.ru_maxrss * 1024, time.monotonic() - started


def refused_cleanly(args: list[str], folder: Path) -> tuple[bool, str]:
    """(refused cleanly, what it said or why not)."""
    args = [a.replace("EMPTY", str(folder / "empty.txt")).replace("NOTES", str(folder / "notes.db")) for a in args]
    command = [sys.executable, "-m", "titan_exp", *args]
    reads_a_store = args[0] in ("ui", "compare") or args[:2] == ["plan", "calibrate"]  # by --uri
    if not reads_a_store and not any(a.startswith("tracking.uri=") for a in args):
        command.append(f"tracking.uri=sqlite:///{folder}/mlflow.db")
    status, stdout, stderr, peak, seconds = run_bounded(command, folder)
    said = stderr.strip().splitlines()
    problems = [
        f"still running after {TIME_BOUND_S} s" if status is None else f"exit {status}" if status != 2 else "",
        f"{peak / 2**30:.1f} GiB" if peak > MEMORY_BOUND else "",
        f"{len(said)} lines" if len(said) != 1 else "",
        "a traceback" if "Traceback" in stderr + stdout else "",
        "a store written" if (folder / "mlflow.db").exists() else "",
        "a run folder left" if (folder / "outputs" / "runs").exists() else "",
    ]
    problems = [p for p in problems if p]
    measured = f"[{peak / 2**20:4.0f} MiB {seconds:4.1f} s]"
    if problems:
        return False, f"{measured} {'; '.join(problems)}" + (f" -- {said[-1][:150]}" if said else "")
    return True, f"{measured} {said[0]}"


def main() -> int:
    clean, started = 0, time.monotonic()
    inputs = [(" ".join(args), lambda _, a=args: a) for args in BAD_INPUTS] + [
        (c.name, c.make) for c in CASES + PROBE_ONLY
    ]
    for label, make in inputs:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "here"
            folder.mkdir()
            (folder / "empty.txt").write_text("")
            (folder / "notes.db").write_text("these are notes\n")
            ok, said = refused_cleanly(make(folder), folder)
        clean += ok
        print(f"{'refused ' if ok else 'NOT CLEAN'}  {label[:60]:60}  {said[:170]}", flush=True)
    print(f"\n{clean} of {len(inputs)} bad inputs refused cleanly ({time.monotonic() - started:.0f} s)")
    return 0 if clean == len(inputs) else 1


if __name__ == "__main__":
    sys.exit(main())

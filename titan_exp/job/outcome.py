"""How a job's end reaches the command line: one line on stderr and the exit status (0 done, 1 the
run failed, 2 the config was refused and nothing started, 128 + N stopped by signal N)."""

import shutil
import signal
import sys
from pathlib import Path

from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from titan_exp.config.compose import key_hint
from titan_exp.config.job import ResolvedJob
from titan_exp.rules import ConfigError
from titan_exp.tracking.config import masked
from titan_exp.tracking.journal import RUN_ID_FILE

EXIT_RUN_FAILED = 1
EXIT_BAD_CONFIG = 2


def say(line: str) -> None:
    print(f"titan_exp: {line}", file=sys.stderr, flush=True)


def where_it_went(job: ResolvedJob, job_dir: Path) -> str:
    """What a finished job left and how to look at it, in one line: its folder, its MLflow run (and
    the command that shows it), its profiling output."""
    said = [f"outputs in {job_dir}"]
    run_id_file = job_dir / RUN_ID_FILE
    if job.store is not None and run_id_file.exists():
        uri = masked(job.store.uri)
        run_id = run_id_file.read_text().strip()
        said.append(f"MLflow run {run_id} in {uri} (see it: python -m titan_exp ui --uri {uri})")
    profiling = job.config.profiling
    for folder in (job_dir / profiling.save_traces_folder, job_dir / profiling.save_memory_snapshot_folder):
        if folder.is_dir():
            said.append(f"profiling in {folder}")
    return "; ".join(said)


def forget_folder(folder: Path, written: list[str]) -> None:
    """A refused job (or sweep) leaves no folder: `written`, what Hydra wrote there before the
    refusal (.hydra/, the job's log, multirun.yaml), goes, then the folder and the folders above it
    that this left empty (outputs/runs/<date>), up to the working directory (the folder alone elsewhere)."""
    for path in (folder / name for name in written):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    folder = folder.absolute()
    above = [p for p in folder.parents if p.is_relative_to(Path.cwd()) and p != Path.cwd()]
    for empty in (folder, *above):
        try:
            empty.rmdir()
        except OSError:  # not empty: something else is there, and so above it
            return


def composition_error(err: Exception) -> str:
    """Hydra's report of a config it could not compose, in one line: its first line, the reason
    OmegaConf gives (a value of the wrong type, an unknown key: then where that key is read, from
    the key OmegaConf names) and a group's options (listed one a line)."""
    said = []
    for part in (err, err.__cause__):  # OmegaConf's reason is the cause: "Key 'foo' not in 'TrainingConfig'"
        lines = [line.strip() for line in str(part or "").splitlines() if line.strip()]
        said += [line.rstrip(".") for line in lines[:1] if not line.startswith(("full_key", "object_type"))]
    if isinstance(err.__cause__, ConfigAttributeError | ConfigKeyError) and err.__cause__.full_key:
        said.append(key_hint(err.__cause__.full_key))
    options = getattr(err, "options", None)
    return ": ".join(said) + (f" (options: {', '.join(options)})" if options else "")


def verdict(err: BaseException) -> tuple[int, str]:
    """How `err` ended the job: the status to exit with and one line that says why. Re-raises what
    is not a job's end (SystemExit and the like)."""
    notes = getattr(err, "__notes__", [])
    if isinstance(err, ConfigError):
        return EXIT_BAD_CONFIG, f"config error: {err}"
    if isinstance(err, KeyboardInterrupt):
        # The status a shell gives a process that such a signal stopped.
        signum = getattr(err, "signum", signal.SIGINT)
        return 128 + signum, "; ".join([f"stopped by {signal.Signals(signum).name}", *notes])
    if isinstance(err, Exception):
        return EXIT_RUN_FAILED, "; ".join([f"run failed: {type(err).__name__}: {err}", *notes])
    raise err


def exit_status(err: BaseException) -> int:
    """Say how `err` ended the job, in one line; the status to exit with."""
    status, line = verdict(err)
    say(line)
    return status

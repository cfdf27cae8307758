"""Rank 0's side of a tracked job: its console copied into the run log, the MLflow writer, and the
run ended the way training ended. Torch-free on purpose: the writer is started before the rank
imports torch, so that the writer's own start-up overlaps the rank's (see BackgroundTracker)."""

import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path

from omegaconf import OmegaConf

from titan_exp.config.schema import JobConfig, RunContext
from titan_exp.tracking.identity import flatten, run_name, run_tags
from titan_exp.tracking.mlflow_run import BackgroundTracker, sigint_ignored
from titan_exp.tracking.run_log import run_log


@contextlib.contextmanager
def tracked_run(cfg: JobConfig, ctx: RunContext, world_size: int, device_kind: str) -> Iterator[BackgroundTracker]:
    """The writer of this job's run while inside. Leaving normally ends the run FINISHED; an
    exception ends it FAILED (KILLED for an interrupt) with the reason, after the traceback and
    the log so far are recorded."""
    with run_log(ctx.run_log_file) as log_copy:
        tracker = _start_writer(cfg, ctx, world_size, device_kind)
        try:
            yield tracker
        except BaseException as err:
            with sigint_ignored():  # the next interrupt must not cut the record short
                log_copy.write(traceback.format_exc())
                log_copy.flush()
                tracker.log_artifact(ctx.run_log_file, "logs")
                tracker.close("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", f"{type(err).__name__}: {err}")
            raise
    tracker.log_artifact(ctx.run_log_file, "logs")
    tracker.close("FINISHED")


def _start_writer(cfg: JobConfig, ctx: RunContext, world_size: int, device_kind: str) -> BackgroundTracker:
    """The writer, with the resolved config and the Hydra files queued as the run's first records."""
    tracker = BackgroundTracker(cfg.tracking, run_name(cfg), run_tags(cfg, world_size, ctx.launcher, device_kind), ctx.run_id_file)
    resolved = OmegaConf.structured(cfg)
    tracker.log_params(flatten(OmegaConf.to_container(resolved)))
    tracker.log_text(OmegaConf.to_yaml(resolved), "config/resolved.yaml")
    for hydra_file in sorted(Path(ctx.job_dir, ".hydra").glob("*.yaml")):
        tracker.log_text(hydra_file.read_text(), f"config/hydra/{hydra_file.name}")
    return tracker

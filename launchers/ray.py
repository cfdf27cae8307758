"""launcher=ray: a job's ranks on a Ray cluster (`ray start`, KubeRay), submitted as one Ray job
through the cluster's job API (`launcher.address`), so that `ray job stop`, the dashboard and
`ray job list` know it as any other. Ray runs the job's driver (launchers/ray_driver.py) on the
head node: it gang-schedules the ranks in a placement group, starts and watches them, and writes
on its output every rank's lines and, last, how the job ended. This process follows that output
(RayJob): each rank's lines into the job folder, rank 0's on the console, the ending as a result or
a failure. Nothing here imports ray until a job asks for it, and nothing imports torch."""

import contextlib
import os
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launchers import signals
from launchers.base import (
    ConfigError,
    JobSpec,
    Launcher,
    PlacedJob,
    Placement,
    PlacementRequest,
    SharedFolder,
    check_one_line,
    check_submitted_from_here,
    ranks_per_node_by_degrees,
)
from launchers.ray_messages import (
    ATTEMPT_VARIABLE,
    DRIVER_STOP_WAIT_SECONDS,
    PAYLOAD_FILE,
    STOP_WAIT_SECONDS,
    SUBMISSION_VARIABLE,
    DriverPayload,
    Expected,
    RayJobEnded,
    follow_messages,
    visibility_token_name,
)

# The Python that runs the driver on the head node, and its module.
DRIVER = "python -m launchers.ray_driver " + PAYLOAD_FILE


@dataclass
class RayOptions:
    """The keys of the `launcher` section that launcher=ray alone reads."""

    # The cluster's job API: auto (RAY_ADDRESS, else the cluster this machine is a node of),
    # http://HEAD:8265 (the dashboard's port), or ray://HEAD:10001 (Ray Client's).
    address: str = "auto"
    # Sweep points placed as Ray jobs at once, at most.
    max_concurrent_jobs: int = 8
    # With checkpoint.enable: how many times a job that lost a node (a rank's node died, or a rank
    # stopped answering) starts again, once the cluster has room, resuming from its last
    # checkpoint in the same MLflow run.
    max_retries: int = 2
    # How long the ranks may wait for the cluster to have room for all of them at once (a
    # placement group is all or nothing) before the job fails.
    placement_timeout_s: float = 600.0
    # Ray's runtime environment for the job's processes beyond what the launcher sets (env_vars,
    # pip, container, ...), a table: https://docs.ray.io/en/latest/ray-core/handling-dependencies.html
    # (typed Any, default null: `launcher.runtime_env={env_vars:{A:b}}` then sets it whole, where
    # an empty table would refuse keys it does not have).
    runtime_env: Any = None

    def check_options(self) -> None:
        check_one_line("launcher.address", self.address)
        if self.address != "auto" and self.address.partition("://")[0] not in ("http", "https", "ray"):
            raise ConfigError(
                "launcher.address", self.address, "must be auto, http://HEAD:8265 (the job API) or ray://HEAD:10001"
            )
        if self.max_concurrent_jobs <= 0:
            raise ConfigError("launcher.max_concurrent_jobs", self.max_concurrent_jobs, "must be > 0")
        if self.max_retries < 0:
            raise ConfigError("launcher.max_retries", self.max_retries, "must be >= 0")
        if not self.placement_timeout_s > 0:
            raise ConfigError("launcher.placement_timeout_s", self.placement_timeout_s, "must be > 0")
        if self.runtime_env is not None:
            _check_runtime_env(self.runtime_env)


class RayLauncher(Launcher):
    name = "ray"
    options = RayOptions
    folder_name = "ray"
    on_this_machine = False

    @staticmethod
    def environment_tags() -> dict[str, str]:
        return {"ray_job_id": os.environ.get(SUBMISSION_VARIABLE, "")}

    def placement(self, request: PlacementRequest) -> Placement:
        """A Ray cluster's nodes are not this machine: counts come from the config alone. Ranks per
        node: launcher.nproc_per_node, else the degrees' product over the nodes; device auto is
        cuda (a CPU cluster says launcher.device=cpu); a rank's threads (and the CPUs its share of
        the placement group asks for): launcher.cpu_threads_per_rank, -1 one."""
        _ray_or_refuse()
        check_submitted_from_here(request, self.name, "a Ray job")
        nproc = request.nproc_per_node
        if nproc == -1:
            nproc = ranks_per_node_by_degrees(request, self.name)
        device = "cuda" if request.device == "auto" else request.device
        threads = request.cpu_threads_per_rank if request.cpu_threads_per_rank != -1 else 1
        return Placement(self.name, device, nproc, request.nodes, threads)

    def restarted(self) -> bool:
        return int(os.environ.get(ATTEMPT_VARIABLE, "0")) > 0

    def points_in_flight(self) -> int:
        return self.section.max_concurrent_jobs

    def refusal(self, spec: JobSpec, folder: Path) -> str | None:
        """Why the job cannot be submitted: no cluster answers at launcher.address."""
        try:
            _client(self.section.address)
        except Exception as err:  # ConnectionError, a timeout, or Ray's RuntimeError/ValueError for auto
            said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return (
                f"no Ray cluster answers at launcher.address={self.section.address} ({said}); start one "
                "(`ray start --head`) or point launcher.address at its job API (http://HEAD:8265)"
            )
        return None

    def place(self, target: Callable[[Any], Any], arg: Any, spec: JobSpec, folder: Path, echo: Callable[[str], None]):
        """Submit the job: its payload (target, arg and how to place them) travels as the Ray job's
        working directory; a token file in each folder every node must see lets the driver check
        that they do."""
        import cloudpickle

        placement, options = spec.placement, self.section
        folder = folder.absolute()
        submit_dir = folder / "submit"
        submit_dir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(8)
        submission_id = f"titan_exp-{time.strftime('%Y%m%d-%H%M%S')}-{token[:6]}"
        payload = DriverPayload(
            job=cloudpickle.dumps((target, arg)),
            submission_id=submission_id,
            device=placement.device,
            nodes=placement.nodes,
            nproc_per_node=placement.nproc_per_node,
            threads_per_rank=placement.threads_per_rank,
            heartbeat_timeout_s=spec.heartbeat_timeout_s,
            retries=options.max_retries if spec.resumable else 0,
            placement_timeout_s=options.placement_timeout_s,
            timeout_s=60.0 * spec.timeout_min,
            cwd=str(Path.cwd()),
            shared_folders=spec.shared_folders,
            token=token,
        )
        (submit_dir / PAYLOAD_FILE).write_bytes(cloudpickle.dumps(payload))
        # Ray gives a stopped job's driver RAY_JOB_STOP_WAIT_TIME_S before SIGKILL: time to stop the ranks.
        theirs = options.runtime_env or {}
        env_vars = {"RAY_JOB_STOP_WAIT_TIME_S": str(DRIVER_STOP_WAIT_SECONDS)} | (theirs.get("env_vars") or {})
        runtime_env = {**theirs, "working_dir": str(submit_dir), "env_vars": env_vars}
        client = _client(options.address)
        # Rank 0's result comes back as plain data: rebuilt as the target says, else as it is.
        expected = Expected(placement.world_size, getattr(target, "result", None) or (lambda data: data))
        job = RayJob(client, submission_id, folder, echo, expected, spec.shared_folders, token)
        try:
            for shared in spec.shared_folders:
                shared.path.mkdir(parents=True, exist_ok=True)
                (shared.path / visibility_token_name(token)).write_text(token)
            client.submit_job(
                entrypoint=DRIVER,
                submission_id=submission_id,
                runtime_env=runtime_env,
                metadata={"titan_exp.run_name": spec.name},
                entrypoint_num_cpus=0,
            )
        except BaseException:  # the id is ours: a job that was submitted after all is stopped
            job.cancel(wait=False)
            job.remove_tokens()
            raise
        ranks = placement.world_size
        echo(
            f"Ray job {submission_id} submitted to {client.get_address()}: {ranks} ranks on {placement.nodes} "
            f"node(s), logs {folder / '<rank>_log.out'}"
        )
        return job


class RayJob(PlacedJob):
    """A submitted Ray job, followed through its driver's output."""

    def __init__(
        self,
        client,
        submission_id: str,
        folder: Path,
        echo: Callable[[str], None],
        expected: Expected,
        shared: tuple[SharedFolder, ...],
        token: str,
    ):
        self.client, self.submission_id, self.folder, self.echo = client, submission_id, folder, echo
        self.expected, self.shared, self.token = expected, shared, token
        self.where = f"Ray job {submission_id}"

    def follow(self) -> Any:
        """Rank 0's result, or what ended the job; a job this process stops following for any other
        reason (an error here, Ctrl-C) is stopped."""
        try:
            return follow_messages(self.client, self.submission_id, self.folder, self.expected, self.echo, self._stop)
        except BaseException as err:
            if not self._ended():  # a Ctrl-C has stopped it and waited already
                self.cancel(wait=not isinstance(err, KeyboardInterrupt))
            raise
        finally:
            self.remove_tokens()

    def cancel(self, wait: bool = True) -> None:
        """`ray job stop`; then wait (STOP_WAIT_SECONDS at most) for the job to end."""
        self._stop()
        deadline = time.monotonic() + (STOP_WAIT_SECONDS if wait else 0.0)
        while time.monotonic() < deadline and not self._ended():
            time.sleep(0.5)

    def remove_tokens(self) -> None:
        for shared in self.shared:
            (shared.path / visibility_token_name(self.token)).unlink(missing_ok=True)

    def _stop(self) -> None:
        with signals.ignored(signal.SIGINT, signal.SIGTERM), contextlib.suppress(Exception):
            self.client.stop_job(self.submission_id)

    def _ended(self) -> bool:
        try:
            return self.client.get_job_status(self.submission_id).is_terminal()
        except Exception:  # not submitted, or the cluster is gone: nothing to stop
            return True


def _client(address: str):
    """The job API client of the cluster at `address`, every request bounded (launchers/ray_client.py)."""
    from launchers.ray_client import client

    return client(address)


def _check_runtime_env(env: object) -> None:
    """launcher.runtime_env as Ray would take it, checked before anything is submitted or written
    (Ray checks it only on submission, or in the cluster): a table of the fields Ray knows
    (`RuntimeEnv.known_fields`, where `nsight` is `_nsight`), each as Ray's own `RuntimeEnv`
    takes it (types, local py_modules paths that exist, fields that go together)."""
    if not isinstance(env, dict):
        raise ConfigError(
            "launcher.runtime_env", env, "must be a table of Ray's runtime_env fields, e.g. {env_vars:{NAME:value}}"
        )
    if "working_dir" in env:
        raise ConfigError(
            "launcher.runtime_env.working_dir",
            env["working_dir"],
            "is the launcher's own (it carries the job); use py_modules or an image with your code",
        )
    _ray_or_refuse()
    from ray.runtime_env import RuntimeEnv

    known = sorted(name for name in RuntimeEnv.known_fields if not name.startswith("_"))
    for name, value in env.items():
        key = f"launcher.runtime_env.{name}"
        if name not in RuntimeEnv.known_fields and f"_{name}" not in RuntimeEnv.known_fields:
            raise ConfigError(key, value, f"is not a field of Ray's runtime_env ({', '.join(known)})")
        _as_ray_takes_it(key, value, {name: value})
    _as_ray_takes_it("launcher.runtime_env", env, env)


def _as_ray_takes_it(key: str, value: object, env: dict) -> None:
    from ray.runtime_env import RuntimeEnv

    try:
        RuntimeEnv(**env)
    except Exception as err:  # Ray's validators raise TypeError, ValueError, and not only
        said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            key,
            value,
            f"Ray refuses it ({said}): see https://docs.ray.io/en/latest/ray-core/handling-dependencies.html",
        ) from None


def _ray_or_refuse() -> None:
    try:
        import ray.job_submission  # noqa: F401
    except ImportError:
        raise ConfigError(
            "launcher", "ray", "needs Ray's job API on this machine: pip install 'ray[default]' (or 'titan_exp[ray]')"
        ) from None


__all__ = ["RayJobEnded", "RayLauncher", "RayOptions"]

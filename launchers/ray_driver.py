"""The driver of a launcher=ray job, which Ray runs on the cluster's head node (`python -m
launchers.ray_driver job.pkl`, in the job's working directory that carries the payload).

It asks for the whole job at once: a placement group of one bundle per node, each holding that
node's ranks (their CPUs, and a GPU each on cuda), STRICT_SPREAD over `nodes` nodes, so that a node's
ranks are together (local ranks, one NVLink domain) and no rank starts before all can. In each
bundle one actor per rank (RankProcess) starts the rank as a child process of its own, with the
torch.distributed environment (rank 0's node address, a port free there), streams its output back
and reports how it ended; the driver writes all of it as messages (launchers/ray_messages.py) for
the process that submitted the job.

How ranks end: a rank that raised fails the job with its last line; a rank whose node died (Ray
marks its actor dead) or that stopped answering (no heartbeat for heartbeat_timeout_s) fails it
naming the node, or, with checkpoints and retries left, starts the whole job again to resume from
its checkpoint. `ray job stop` (SIGTERM here) stops every rank and ends the job STOPPED."""

import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import cloudpickle
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from launchers.base import ConfigError
from launchers.env import RankEnv
from launchers.heartbeat import silence
from launchers.ray_messages import (
    ATTEMPT_VARIABLE,
    RANK_STOP_GRACE_SECONDS,
    SUBMISSION_VARIABLE,
    DriverPayload,
    Failure,
    Note,
    Refusal,
    Result,
    Unfinished,
    rank_lines,
    say,
)
from launchers.ray_rank import RankProcess
from launchers.signals import raise_interrupted
from launchers.tasks import last_line

RankActor = ray.remote(RankProcess)
# How long ranks left behind by a failed one get after SIGINT: stuck in a collective with a peer that
# is gone, they rarely take it (the launching process ends the MLflow run for them).
FAILED_STOP_GRACE_SECONDS = 5.0

# How often every rank is asked for its output and state.
POLL_SECONDS = 1.0
# How long starting the rank actors may take (a worker process per rank: Ray's own start-up).
ACTOR_START_SECONDS = 300.0


class Place(NamedTuple):
    """Where a rank's actor runs: its node's address, the interface holding it ("" where the node
    sets GLOO_SOCKET_IFNAME itself, or none holds it), and Ray's id of the node."""

    address: str
    interface: str
    node_id: str | None


class RankFailed(Exception):
    def __init__(self, rank: int, reason: str):
        self.rank, self.reason = rank, reason


class NodeLost(RankFailed):
    """A rank's node died or the rank stopped answering: the job may start again where it can resume."""


class Ended(Exception):
    """The job cannot go on (no room on the cluster, or past its time limit: `timed_out`)."""

    def __init__(self, why: str, timed_out: bool = False):
        super().__init__(why)
        self.timed_out = timed_out


def main(payload_file: str) -> int:
    payload: DriverPayload = cloudpickle.loads(Path(payload_file).read_bytes())
    ray.init(log_to_driver=False, logging_level="WARNING")
    # `ray job stop` sends SIGTERM: the ranks are stopped (_run's finally) before this exits.
    # After ray.init, which sets a handler of its own.
    signal.signal(signal.SIGTERM, raise_interrupted)
    deadline = time.monotonic() + payload.timeout_s
    for attempt in range(payload.retries + 1):
        try:
            result = _run(payload, attempt, deadline)
        except NodeLost as lost:
            if attempt < payload.retries:
                say(
                    Note(
                        f"rank {lost.rank} {lost.reason}; the job starts again to resume from its last checkpoint "
                        f"(attempt {attempt + 2} of {payload.retries + 1}, launcher.max_retries)"
                    )
                )
                continue
            say(Failure(lost.rank, lost.reason))
            return 1
        except RankFailed as failed:
            say(Failure(failed.rank, failed.reason))
            return 1
        except ConfigError as refused:  # the cluster cannot run the job as configured
            if attempt == 0:  # nothing ran: a config error
                say(Refusal(refused.key, str(refused.value), refused.fix))
            else:  # its run exists: it fails
                say(Unfinished(str(refused), timed_out=False))
            return 1
        except Ended as ended:
            say(Unfinished(str(ended), timed_out=ended.timed_out))
            return 1
        say(Result(result))
        return 0
    raise AssertionError("unreachable: the last attempt returns")


def _run(p: DriverPayload, attempt: int, deadline: float) -> Any:
    """One attempt at the job: place, start and watch its ranks; rank 0's result (plain data)."""
    bundle = {"CPU": float(p.threads_per_rank * p.nproc_per_node)}
    if p.device == "cuda":
        bundle["GPU"] = float(p.nproc_per_node)
    if attempt == 0:
        _check_room(bundle, p.nodes)
    group = placement_group([bundle] * p.nodes, strategy="STRICT_SPREAD" if p.nodes > 1 else "PACK")
    ranks: list = []
    grace_s = RANK_STOP_GRACE_SECONDS  # to stop ranks that are well (`ray job stop`)
    try:
        left_s = deadline - time.monotonic()
        try:
            ray.get(group.ready(), timeout=max(min(p.placement_timeout_s, left_s), 1.0))
        except GetTimeoutError:
            if left_s < p.placement_timeout_s:
                raise Ended(
                    "it ran past launcher.timeout_min waiting for room on the cluster", timed_out=True
                ) from None
            raise Ended(
                f"the cluster had no room for {p.nodes} node(s) of {_resources(bundle)} at once within "
                f"launcher.placement_timeout_s={p.placement_timeout_s:g}"
            ) from None
        world = p.nodes * p.nproc_per_node
        for rank in range(world):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank // p.nproc_per_node)
            ranks.append(
                RankActor.options(
                    num_cpus=p.threads_per_rank, num_gpus=1 if p.device == "cuda" else 0, scheduling_strategy=strategy
                ).remote()
            )
        places = _start(ranks, p, attempt)
        try:
            return _watch(ranks, places, p.heartbeat_timeout_s, deadline)
        except RankFailed:
            grace_s = FAILED_STOP_GRACE_SECONDS  # the others wait for a peer that is gone
            raise
    finally:
        _stop(ranks, grace_s)
        with contextlib.suppress(Exception):
            remove_placement_group(group)


def _start(ranks: list, p: DriverPayload, attempt: int) -> list[Place]:
    """Where each rank's actor is, the folders checked, and each rank started with its
    torch.distributed environment. An actor lost meanwhile is its node's loss (or its process's)."""
    world = len(ranks)
    places: list[Place] = [Place("?", "", None)] * world
    try:
        places = [Place(*place) for place in ray.get([r.where.remote() for r in ranks], timeout=ACTOR_START_SECONDS)]
        say(Note(f"ranks placed by Ray: {_layout([place.address for place in places])}"))
        unseen = ray.get([r.missing.remote(p.shared_folders, p.token) for r in ranks], timeout=ACTOR_START_SECONDS)
        for place, folders in zip(places, unseen, strict=True):
            for folder in folders:
                raise ConfigError(
                    folder.key, folder.value, f"{folder.fix} (Ray node {place.address} does not see {folder.path})"
                )
        port = ray.get(ranks[0].free_port.remote(), timeout=ACTOR_START_SECONDS)
        starts = []
        for rank, actor in enumerate(ranks):
            env = RankEnv(rank, rank % p.nproc_per_node, world, p.nproc_per_node)
            variables = {
                **env.variables(),
                "MASTER_ADDR": places[0].address,
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(p.threads_per_rank),
                SUBMISSION_VARIABLE: p.submission_id,
                ATTEMPT_VARIABLE: str(attempt),
            }
            if places[rank].interface:  # gloo binds where Ray's node address is
                variables["GLOO_SOCKET_IFNAME"] = places[rank].interface
            starts.append(actor.start.remote(p.job, variables, p.cwd))
        ray.get(starts, timeout=ACTOR_START_SECONDS)
    except RayActorError as err:
        rank = next((i for i, r in enumerate(ranks) if r._actor_id.hex() == err.actor_id), 0)  # hex, or None
        raise _actor_died(rank, places[rank], err) from None
    except GetTimeoutError:
        raise Ended(f"the ranks' actors did not start within {ACTOR_START_SECONDS:g} s") from None
    return places


def _check_room(bundle: dict[str, float], nodes: int) -> None:
    """Refuse at once a job no node count of this cluster could ever hold (rather than wait out the
    placement timeout): fewer than `nodes` alive nodes with the bundle's resources in all."""
    fitting = [
        node["NodeManagerAddress"]
        for node in ray.nodes()
        if node["Alive"] and all(node["Resources"].get(key, 0.0) >= amount for key, amount in bundle.items())
    ]
    if len(fitting) < nodes:
        raise ConfigError(
            "launcher.nodes",
            str(nodes),
            f"the Ray cluster has {len(fitting)} node(s) with {_resources(bundle)} (a node's ranks: "
            "launcher.nproc_per_node × launcher.cpu_threads_per_rank CPUs, a GPU each with launcher.device=cuda); "
            "ask for fewer or smaller nodes",
        )


def _resources(bundle: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {key}" for key, amount in bundle.items())


def _layout(hosts: list[str]) -> str:
    """'ranks 0-1 on 10.0.0.2, ranks 2-3 on 10.0.0.3'."""
    spans: list[list] = []
    for rank, host in enumerate(hosts):
        if spans and spans[-1][2] == host:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank, host])
    return ", ".join(f"rank {a} on {h}" if a == b else f"ranks {a}-{b} on {h}" for a, b, h in spans)


def _watch(ranks: list, places: list[Place], heartbeat_timeout_s: float, deadline: float) -> Any:
    """Ask every rank for its output and state each POLL_SECONDS until all finished; rank 0's
    result, or raise what ended the job, the root cause first: a lost node, then a rank
    gone without a result, then the rank that raised. A rank that raised is held back while
    another's answer is late: a node that dies resets its peers' connections, and they raise
    before Ray (or the heartbeat limit) names the node."""
    answered = [time.monotonic()] * len(ranks)
    asked: dict[int, ray.ObjectRef] = {}
    results: dict[int, Any] = {}
    failed: list[RankFailed] = []  # exited without a result: gone first, then raised
    while len(results) < len(ranks):
        round_end = time.monotonic() + POLL_SECONDS
        if round_end > deadline:
            raise Ended("it ran past launcher.timeout_min; its ranks were stopped", timed_out=True)
        finished = results.keys() | {failure.rank for failure in failed}
        for rank, actor in enumerate(ranks):
            if rank not in asked and rank not in finished:
                asked[rank] = actor.poll.remote()
        ray.wait(list(asked.values()), num_returns=len(asked), timeout=POLL_SECONDS)
        for rank, ref in list(asked.items()):
            try:
                state = ray.get(ref, timeout=0)
            except GetTimeoutError:  # late: lost once silent past the limit
                silent = time.monotonic() - answered[rank]
                if silent > heartbeat_timeout_s:
                    reason = silence(silent, heartbeat_timeout_s, "its ranks stopped", places[rank].address)
                    raise NodeLost(rank, reason) from None
                continue
            except ActorUnavailableError:  # unreachable for now (Ray retries): asked again next round
                del asked[rank]
                continue
            except RayActorError as err:
                raise _actor_died(rank, places[rank], err) from None
            del asked[rank]
            answered[rank] = time.monotonic()
            for line in state["lines"]:
                for piece in rank_lines(rank, line):
                    say(piece)
            if state["silent_s"] is not None and state["silent_s"] > heartbeat_timeout_s:
                reason = silence(state["silent_s"], heartbeat_timeout_s, "its ranks stopped", places[rank].address)
                raise NodeLost(rank, reason)
            if state["exit"] is None:
                continue
            outcome = state["outcome"]
            if outcome is None:
                failed.insert(0, RankFailed(rank, f"exited with status {state['exit']} without a result"))
            elif "error" in outcome:
                failed.append(RankFailed(rank, last_line(outcome["error"])))
            else:
                results[rank] = outcome["result"]
        if failed and not asked:  # every rank still running answered: none was lost
            raise failed[0]
        time.sleep(max(round_end - time.monotonic(), 0.0))
    return results[0]


def _actor_died(rank: int, place: Place, err: RayActorError) -> Exception:
    """A rank's actor is dead: its node died (Ray no longer counts it alive; Ray reports an actor
    lost with its node once it marked the node dead), or only its process."""
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    said = last_line(str(err))
    if place.node_id not in alive:
        return NodeLost(rank, f"lost its node {place.address}: Ray marked the node dead ({said})")
    return RankFailed(rank, f"its Ray worker process on {place.address} died ({said})")


def _stop(ranks: list, grace_s: float) -> None:
    """Every rank still running stopped (SIGINT, SIGKILL after `grace_s`), then its actor."""
    stops = []
    for actor in ranks:
        with contextlib.suppress(Exception):
            stops.append(actor.stop.remote(grace_s))
    with contextlib.suppress(Exception):
        ray.wait(stops, num_returns=len(stops), timeout=grace_s + 10)
    for actor in ranks:
        with contextlib.suppress(Exception):
            ray.kill(actor)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

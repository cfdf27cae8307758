"""One rank of a launcher=ray job: an actor (RankProcess) that the driver (launchers/ray_driver.py)
places in its node's bundle, and the rank process it starts as a child of its own (`python -m
launchers.ray_rank FOLDER ACTOR_PID`), as submitit's tasks are started locally: a process whose
main thread is the rank's, which takes signals (Ctrl-C, SIGUSR2) as any rank does. The actor
answers the driver's polls from the rank's node: the rank's new output lines, its heartbeat's age
(launchers/heartbeat.py: a stopped rank stops beating), and once it exited, its result. Its files
live in a folder of the node's own temporary space, removed when it stops."""

import contextlib
import faulthandler
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import psutil

from launchers import rendezvous
from launchers.heartbeat import heartbeat_file, silent_for, start_beating
from launchers.processes import stop_when_gone
from launchers.tasks import run_recording_failures

_PAYLOAD, _RESULT, _LOG = "job.pkl", "result.json", "log.out"


class RankProcess:
    """What the actor that holds one rank does (the driver makes it an actor: Ray is imported there)."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="titan_exp_rank_"))
        self.process: subprocess.Popen | None = None
        self.offset = 0

    def where(self) -> tuple[str, str, str]:
        """This node's address, as Ray and the other ranks reach it; the network interface that
        holds it, for gloo ("" where the node sets GLOO_SOCKET_IFNAME itself); Ray's node id."""
        import ray

        address = ray.util.get_node_ip_address()
        interface = "" if "GLOO_SOCKET_IFNAME" in os.environ else interface_of(address) or ""
        return address, interface, ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        """A port free on every address of this node, for rank 0's rendezvous."""
        return rendezvous.free_port()

    def missing(self, folders: tuple, token: str) -> list:
        """The folders of `folders` whose token file this node does not see (not the launching
        machine's disk, or another job's folder)."""
        from launchers.ray_messages import visibility_token_name

        unseen = []
        for folder in folders:
            try:
                seen = (folder.path / visibility_token_name(token)).read_text() == token
            except OSError:
                seen = False
            if not seen:
                unseen.append(folder)
        return unseen

    def start(self, job: bytes, variables: dict[str, str], cwd: str) -> None:
        """Start the rank: `job` (its pickled callable and argument) run in a child process with
        torch.distributed's `variables`, in `cwd` where this node has it."""
        (self.folder / _PAYLOAD).write_bytes(job)
        with (self.folder / _LOG).open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-u", "-m", "launchers.ray_rank", str(self.folder), str(os.getpid())],
                env={**os.environ, **variables},
                cwd=cwd if Path(cwd).is_dir() else self.folder,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def poll(self) -> dict[str, Any]:
        """The rank's new complete output lines (all that is left once it exited), seconds since
        its last heartbeat (None before the first, or once exited), its exit status (None while it
        runs) and, once exited, its outcome ({"result": plain data} or {"error": traceback}; None
        if it left none)."""
        code = self.process.poll()  # first: once it exited, the log holds all it wrote
        with (self.folder / _LOG).open("rb") as log:
            log.seek(self.offset)
            text = log.read()
        taken = text if code is not None else text[: text.rfind(b"\n") + 1]
        self.offset += len(taken)
        state = {"lines": taken.decode(errors="replace").splitlines(), "exit": code, "outcome": None}
        state["silent_s"] = None if code is not None else silent_for(heartbeat_file(self.folder, "rank", 0))
        if code is not None and (self.folder / _RESULT).exists():
            state["outcome"] = json.loads((self.folder / _RESULT).read_text())
        return state

    def stop(self, grace_s: float) -> None:
        """SIGINT to a rank still running (it ends its run as interrupted), SIGKILL past `grace_s`,
        or at once where it is stopped (SIGSTOP, a debugger: it would take no SIGINT); the folder
        removed."""
        process = self.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=0.0 if _stopped(process.pid) else grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal or a tracer (/proc: state T or t)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def interface_of(address: str) -> str | None:
    """The network interface that holds the IPv4 `address` on this machine (None: none does).
    Gloo otherwise binds to what the hostname resolves to, which on a pod or a namespace may be
    a loopback address the other nodes cannot reach."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    return None


def _rank_main(folder: Path, actor_pid: int) -> int:
    """The rank process: run the job's callable, leave {"result": value} or {"error": traceback}
    as JSON in the result file (written whole or not at all). The result goes back to the
    launching machine as JSON (launchers/ray_messages.py): plain data, or a dataclass of plain data
    (as its fields)."""
    stop_when_gone(actor_pid)  # also listens to SIGINT
    faulthandler.enable()
    start_beating(heartbeat_file(folder, "rank", 0))
    target, arg = cloudpickle.loads((folder / _PAYLOAD).read_bytes())
    try:
        result = run_recording_failures(target, arg)
        outcome = {"result": asdict(result) if is_dataclass(result) and not isinstance(result, type) else result}
        text = json.dumps(outcome)
    except Exception:
        traceback.print_exc()
        outcome = {"error": traceback.format_exc()}
        text = json.dumps(outcome)
    partial = folder / (_RESULT + ".partial")
    partial.write_text(text)
    partial.replace(folder / _RESULT)
    return 0 if "result" in outcome else 1


if __name__ == "__main__":
    sys.exit(_rank_main(Path(sys.argv[1]), int(sys.argv[2])))

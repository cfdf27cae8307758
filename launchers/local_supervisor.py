"""The rank processes of a local job (launchers/local.py starts them), supervised from the launching
process: rank 0's output streamed, every rank watched (its result, its process, its heartbeat),
and on the first failure the others stopped, so a dead rank never leaves the rest hanging in a
collective and no process outlives the launch."""

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from launchers import signals
from launchers.heartbeat import heartbeat_file, silence, silent_for
from launchers.processes import children, process_alive
from launchers.tasks import LogFollower, RankFailure, oom_kills, read_result, why_gone

# How long the supervisor sleeps at most between two looks at the ranks: rank 0's output and the
# end of the controller or of a rank wake it at once (_Wakeups), so on CPU ranks that fill every
# core it does not take their cores on a timer (a 0.1 s poll cost ~2-3% tokens/s, 3 pairs).
POLL_SECONDS = 0.5
# After SIGINT, how long ranks get to finish what they were writing (rank 0 flushes its MLflow
# queue) before SIGKILL.
INTERRUPT_GRACE_SECONDS = 30.0


def pid_file_name(job_id: str, rank: int) -> str:
    # Named after the job like submitit's own files, so a reused folder holds no stale pids.
    return f"{job_id}_{rank}.pid"


class Supervisor:
    def __init__(
        self,
        job: submitit.local.local.LocalJob,
        nproc: int,
        folder: Path,
        heartbeat_timeout_s: float,
        echo: Callable[[str], None],
    ):
        self.job, self.nproc, self.folder = job, nproc, folder
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.oom_kills_before = oom_kills()
        self.logs = [job.task(rank).paths.stdout for rank in range(nproc)]
        self.rank0_output = LogFollower(self.logs[0], echo)
        self.wakeups = _Wakeups(self.logs[0])

    def run(self) -> Any:
        with signals.handled(signals.raise_interrupted, signal.SIGTERM):
            try:
                while True:
                    self.rank0_output.poll()
                    failure = self._first_failure()
                    if failure:
                        raise failure
                    if self.job.done():
                        break
                    controller = {self.job._process.pid} if self.job._process else set()
                    self.wakeups.sleep(POLL_SECONDS, self._listening_pids() | controller)
                self.rank0_output.poll()
                failure = self._first_failure(final=True)
                if failure:
                    raise failure
                return read_result(0, self.job.task(0).paths.result_pickle, self.logs[0])[1]
            finally:
                self.wakeups.close()
                self.stop_all()

    def _first_failure(self, final: bool = False) -> RankFailure | None:
        """The root cause among failed ranks, or None.

        A rank gone without a result (killed by a signal: OOM killer, kill -9) comes first, since the
        others then fail in their next collective; otherwise the earliest exception.
        """
        killed, raised = [], []
        for rank in range(self.nproc):
            result = self.job.task(rank).paths.result_pickle
            try:
                if read_result(rank, result, self.logs[rank])[0]:
                    continue
            except RankFailure as failure:
                raised.append((result.stat().st_mtime, failure))
                continue
            pid_file = self.folder / pid_file_name(self.job.job_id, rank)
            if (pid_file.exists() and not process_alive(int(pid_file.read_text()))) or final:
                reason = f"exited without a result: {why_gone(self.logs[rank], self.oom_kills_before)}"
                killed.append(RankFailure(rank, reason, self.logs[rank]))
        if killed:
            return killed[0]
        if raised:
            return min(raised, key=lambda pair: pair[0])[1]
        return self._silent_rank()

    def _silent_rank(self) -> RankFailure | None:
        """A live rank whose heartbeat stopped for longer than the limit: killed at once (a stopped
        process takes no SIGINT, and its peers wait for it in a collective until theirs time out)."""
        for rank in range(self.nproc):
            silent = silent_for(heartbeat_file(self.folder, self.job.job_id, rank))
            pid_file = self.folder / pid_file_name(self.job.job_id, rank)
            if silent is None or silent <= self.heartbeat_timeout_s or not pid_file.exists():
                continue
            pid = int(pid_file.read_text())
            if not process_alive(pid):  # done (its result is read) or dead (found as killed)
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return RankFailure(rank, silence(silent, self.heartbeat_timeout_s, "killed"), self.logs[rank])
        return None

    def stop_all(self) -> None:
        """Stop every rank (SIGINT, then SIGKILL after a grace period); the controller then exits.

        Ranks are signalled directly: submitit's own cancel interrupts the controller, which then
        prints a traceback, and submitit's tasks ignore SIGTERM. Another Ctrl-C during the grace
        period ends it: SIGKILL at once.
        """
        try:
            self._signal_ranks(signal.SIGINT, INTERRUPT_GRACE_SECONDS)
        except KeyboardInterrupt:
            pass
        with signals.ignored(signal.SIGINT, signal.SIGTERM):
            self._signal_ranks(signal.SIGKILL, 5.0)
            controller = self.job._process
            if controller is not None:
                try:
                    controller.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    controller.kill()
                    controller.wait()

    def _signal_ranks(self, sig: signal.Signals, grace: float) -> None:
        """Send `sig` to every live rank and wait up to `grace` seconds for them to exit. A rank
        still starting ignores SIGINT until _rank_entry listens (and then writes its pid file): it
        gets the signal again once its pid file appears."""
        listening = self._listening_pids()
        pids = self._rank_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
            for pid in self._listening_pids() - listening:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                listening.add(pid)
            time.sleep(0.05)

    def _listening_pids(self) -> set[int]:
        """Ranks that wrote their pid file, which they do once they handle SIGINT."""
        return {int(p.read_text()) for p in self.folder.glob(pid_file_name(self.job.job_id, "*"))}

    def _rank_pids(self) -> list[int]:
        """Live rank processes: those that wrote a pid file and any other child of the controller."""
        pids = self._listening_pids()
        controller = self.job._process
        if controller is not None:
            pids |= children(controller.pid)
        return [pid for pid in pids if process_alive(pid)]


class _Wakeups:
    """What ends the supervisor's sleep early: a process of the job exiting (a pidfd becomes
    readable) or rank 0's log growing (inotify). Each exit wakes it once."""

    def __init__(self, log: Path):
        self._log = log
        self._pidfds: dict[int, int | None] = {}  # None: exited (or gone before it was watched)
        self._inotify = _inotify_init()  # None where there is none: then the timeout alone
        self._watching_log = False

    def sleep(self, timeout: float, pids: set[int]) -> None:
        for pid in pids - self._pidfds.keys():
            try:
                self._pidfds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                self._pidfds[pid] = None
        if self._inotify is not None and not self._watching_log and self._log.exists():
            self._watching_log = _LIBC.inotify_add_watch(self._inotify, os.fsencode(self._log), _IN_MODIFY) >= 0
        watched = {fd: pid for pid, fd in self._pidfds.items() if fd is not None}
        log = [self._inotify] if self._watching_log else []
        ready, _, _ = select.select([*watched, *log], [], [], timeout)
        for fd in ready:
            if fd in watched:
                os.close(fd)
                self._pidfds[watched[fd]] = None
            else:
                with contextlib.suppress(BlockingIOError):
                    while os.read(fd, 4096):  # the events: only that the log grew matters
                        pass

    def close(self) -> None:
        for fd in [*self._pidfds.values(), self._inotify]:
            if fd is not None:
                os.close(fd)


_LIBC = ctypes.CDLL(None, use_errno=True)
_IN_MODIFY = 0x2  # <sys/inotify.h>


def _inotify_init() -> int | None:
    fd = getattr(_LIBC, "inotify_init1", lambda flags: -1)(os.O_NONBLOCK | os.O_CLOEXEC)
    return fd if fd >= 0 else None

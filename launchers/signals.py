"""Signal handlers swapped for the duration of a block, and restored after it."""

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

Handler = Callable[[int, object], None] | int


@contextlib.contextmanager
def handled(handler: Handler, *signals: signal.Signals) -> Iterator[None]:
    """`signals` go to `handler` while inside; only the main thread can change handlers, elsewhere
    this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def ignored(*signals: signal.Signals) -> contextlib.AbstractContextManager[None]:
    """`signals` ignored while inside (processes started meanwhile inherit that): for what must
    not be cut short."""
    return handled(signal.SIG_IGN, *signals)


class Interrupted(KeyboardInterrupt):
    """A signal that stops the process the way Ctrl-C does (SIGTERM from torchrun, Slurm, kill)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def raise_interrupted(signum: int, frame: object) -> None:
    """A handler: raise Interrupted for `signum` wherever the main thread is."""
    raise Interrupted(signum)


class LauncherDied(KeyboardInterrupt):
    """The process that launched this rank is gone (killed outright): the rank stops, as if
    interrupted, rather than train on for nobody."""

    def __init__(self, launcher_pid: int):
        super().__init__(f"the launching process (pid {launcher_pid}) died")


class StopRequested(KeyboardInterrupt):
    """The job was asked to stop (Slurm's SIGUSR2 ahead of its time limit, or a preemption) and its
    ranks stopped together after `step`, its checkpoint saved if checkpointing is on."""

    def __init__(self, step: int, signal_name: str):
        self.step, self.signal_name = step, signal_name
        super().__init__(f"{signal_name} at step {step}: the job was asked to stop (Slurm time limit or preemption)")


# The signal that asked this process to stop, once one has (see stop_on).
_stop_signal: signal.Signals | None = None


def stop_on(sig: signal.Signals) -> None:
    """From now on `sig` is remembered instead of acted on; the training loop asks stop_requested()
    at each step and the ranks agree to stop together."""

    def remember(signum: int, frame: object) -> None:
        global _stop_signal
        _stop_signal = signal.Signals(signum)

    signal.signal(sig, remember)


def stop_requested() -> str | None:
    """The name of the signal that asked this process to stop, if one has."""
    return _stop_signal.name if _stop_signal is not None else None

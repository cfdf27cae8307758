"""Signals held off while something must not be cut short."""

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def ignored(*signals: signal.Signals) -> Iterator[None]:
    """`signals` ignored while inside (processes started meanwhile inherit that); only the main
    thread can change handlers, elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

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

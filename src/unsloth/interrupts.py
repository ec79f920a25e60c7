"""SIGTERM and SIGHUP end work the way Ctrl-C does, so every cleanup (a half-built environment, a
partial export file, a checkpoint being written) runs for them too."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM / SIGHUP raise KeyboardInterrupt (only the main thread can catch signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    names = [name for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]
    old = {name: signal.signal(getattr(signal, name), interrupt) for name in names}
    try:
        yield
    finally:
        for name, handler in old.items():
            signal.signal(getattr(signal, name), handler)

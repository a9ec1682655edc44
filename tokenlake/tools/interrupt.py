"""SIGTERM as an interrupt: a command stopped by a service manager, ``timeout`` or
``kill`` unwinds as on Ctrl-C, so the pools, servers and processes it started are
stopped and their shared memory and files removed (exit code 143)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread (a KeyboardInterrupt: what unwinds on Ctrl-C
    unwinds on it too)."""


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
    raise Terminated


def sigterm_raises() -> Callable[[], None] | None:
    """Makes SIGTERM raise :class:`Terminated` in the main thread; returns what puts the
    previous handler back (None outside the main thread: nothing was changed)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.signal(signal.SIGTERM, _terminate)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)

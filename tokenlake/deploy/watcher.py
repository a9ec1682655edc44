"""The death watcher of a local cluster's engines: a thread that waits on every engine
process's sentinel and reports an engine that dies without being told to (killed,
crashed, out of memory) within milliseconds, without waiting for a request to time
out (``LocalCluster.add_failure_listener``)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

Key = tuple[str, int]  # (role, instance)


class EngineWatcher:
    """Watches the processes of ``procs`` (the launcher's live dict, read under
    :attr:`lock`). ``leaving`` holds the instances whose engines stop on purpose (no
    failure); ``failures`` maps a dead engine to when it was seen dead; ``listeners``
    are called as ``listener(role, instance)`` on the watcher's thread."""

    def __init__(self, procs: dict[Key, mp.Process]) -> None:
        self.procs = procs
        self.lock = threading.Lock()
        self.leaving: set[int] = set()
        self.failures: dict[Key, float] = {}
        self.listeners: list[Callable[[str, int], None]] = []
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None  # a self-pipe
        self._stop = False

    def start(self) -> None:
        self._wake = os.pipe()
        self._stop = False
        self._thread = threading.Thread(target=self._watch, name="tokenlake-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop = True
        os.write(self._wake[1], b"x")
        self._thread.join()
        self._thread = None
        for fd in self._wake:
            os.close(fd)
        self._wake = None

    def poke(self) -> None:
        """The set of engines changed: wait on the new sentinels."""
        if self._wake is not None:
            os.write(self._wake[1], b"x")

    def _watch(self) -> None:
        """Waits on the engines' sentinels; reports each unexpected death once."""
        while not self._stop:  # checked before each wait: a wake-up byte may be read already
            with self.lock:
                watched = {proc.sentinel: key for key, proc in self.procs.items()
                           if key[1] not in self.leaving and key not in self.failures}
            ready = mp.connection.wait([*watched, self._wake[0]])
            if self._stop:
                return
            if self._wake[0] in ready:
                os.read(self._wake[0], 4096)
            for sentinel in ready:
                key = watched.get(sentinel)
                if key is None:
                    continue
                with self.lock:
                    if key[1] in self.leaving or self.procs.get(key) is None or \
                            self.procs[key].sentinel != sentinel:
                        continue  # stopped on purpose, or already replaced
                    self.failures[key] = time.monotonic()
                proc = self.procs[key]
                log.warning("the %s engine of instance %d (pid %s) died (exit code %s)",
                            key[0], key[1], proc.pid, proc.exitcode)
                for listener in list(self.listeners):
                    try:
                        listener(*key)
                    except Exception:  # a listener's bug must not stop the watching
                        log.exception("failure listener %r failed", listener)

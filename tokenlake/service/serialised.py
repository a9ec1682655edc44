"""``Serialised``: a control plane shared by the control server's thread and the
serving process's own callers (the HTTP serving loop), every call under one lock."""

from __future__ import annotations

import threading
from typing import Any


class Serialised:
    """Calls ``target``'s methods with ``lock`` held; ``get_prefix_tree`` returns the
    tree wrapped the same way (its ``match`` reads state the server's thread changes).
    Attributes that are not methods are read under the lock too."""

    def __init__(self, target: Any, lock: threading.RLock) -> None:
        self._target, self._lock = target, lock

    def __getattr__(self, name: str) -> Any:
        with self._lock:
            value = getattr(self._target, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                out = value(*args, **kwargs)
            return Serialised(out, self._lock) if name == "get_prefix_tree" else out

        return call

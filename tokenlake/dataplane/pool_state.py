"""The state file of a served pool: what a new control process needs to adopt the
engines of one that died (docs/design.md §4 "Restart").

``tokenlake serve`` keeps ``$TOKENLAKE_HOME/pool-PORT.json`` (PORT: its control port),
mode 0600, while its pool runs: the cluster id, the owner's pid and start time, the
settings the pool was built with, every engine's pid and endpoint, every instance's
buffers, the pool's CURVE keys (the owner's secret ones too; not its grant key, which
each owner makes afresh) and the files it wrote beside it (the control port's
credentials). A restart on the same port reads it, finds the engines waiting,
and adopts them with these keys; the file is removed when the pool stops, and by the
engines themselves when their grace ends without a new owner (:func:`forget`), so it
never outlives the pool.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from tokenlake.dataplane import credentials
from tokenlake.dataplane.credentials import home

#: the state file's layout; a file of another version is not adopted
STATE_VERSION = 1


def path_for(control_port: int) -> Path:
    """Where the pool served on ``control_port`` keeps its state."""
    return home() / f"pool-{int(control_port)}.json"


def write(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Writes ``state`` to ``path``, mode 0600 from the start, renamed into place (a
    reader never sees half a file: :func:`tokenlake.dataplane.credentials.write`)."""
    return credentials.write(path, {"version": STATE_VERSION, **state})


def read(path: str | os.PathLike) -> dict[str, Any] | None:
    """The state in ``path``; ``None`` when there is none, or it is unreadable or of
    another version (nothing to adopt)."""
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        return None
    return state


def forget(path: str | os.PathLike | None, cluster_id: str, owner_pid: int | None = None) -> None:
    """Removes the state file at ``path`` and the files it names (``leftovers``: the
    credentials file), if it is still ``cluster_id``'s (a pool started since on the same
    port keeps its own) and, with ``owner_pid``, that process's (a process that did not
    adopt the pool leaves the file of the one waiting)."""
    if path is None:
        return
    state = read(path)
    if state is None or state.get("cluster_id") != cluster_id:
        return
    if owner_pid is not None and state.get("owner_pid") != owner_pid:
        return
    for leftover in [*state.get("leftovers", ()), path]:
        with contextlib.suppress(OSError):
            os.unlink(leftover)


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/PID/stat``),
    so that a pid taken over by another process is not mistaken for it; ``None`` when
    unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def owner_alive(state: dict[str, Any]) -> bool:
    """Whether the process that wrote ``state`` still runs (the same process: its start
    time is checked where it was recorded)."""
    from tokenlake.dataplane.shm_files import pid_alive

    pid = state.get("owner_pid")
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid() or not pid_alive(pid):
        return False
    start = state.get("owner_start")
    return start is None or process_start(pid) == start

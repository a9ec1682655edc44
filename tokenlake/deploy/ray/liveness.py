"""Whether an actor's process is alive, seen from its node without a Ray call.

A client checks its own engines on every wait (``InstanceClient``'s ``dead`` callback),
so the check must be cheap: it reads ``/proc/<pid>/stat`` and compares the kernel's
start time of the process, so that a reused pid is not mistaken for the engine.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import ray


def _proc_stat(pid: int) -> list[bytes] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (None: no such process; [] without /proc)."""
    if not os.path.isdir("/proc/self"):
        return []
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except (OSError, IndexError):
        return []


@dataclass(frozen=True)
class ProcessRef:
    """One actor's process: node, pid and kernel start time (so a reused pid is not
    mistaken for it). :meth:`alive` works only on ``node``.

    Attributes:
        node: Ray node id of the process.
        pid: its pid on that node.
        start: its start time in clock ticks since boot (``/proc/<pid>/stat`` field
            22); empty when unknown (then only the pid is checked).
        ip: the node's address as Ray knows it.
    """

    node: str
    pid: int
    start: str = ""
    ip: str = ""

    @classmethod
    def this(cls) -> ProcessRef:
        """The calling process (inside a Ray worker or driver)."""
        stat = _proc_stat(os.getpid()) or []
        start = stat[19].decode() if len(stat) > 19 else ""
        ctx = ray.get_runtime_context()
        return cls(ctx.get_node_id(), os.getpid(), start, ray.util.get_node_ip_address())

    def alive(self) -> bool:
        """Whether the process runs (not a zombie, same start time); call on ``node``."""
        stat = _proc_stat(self.pid)
        if stat is None:
            return False
        if not stat:  # no /proc: ask the kernel
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
            return True
        if stat[0] in (b"Z", b"X"):
            return False
        return not self.start or (len(stat) > 19 and stat[19].decode() == self.start)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def wait_gone(procs: Iterable[ProcessRef | None], node: str, timeout_s: float = 10.0) -> None:
    """Waits until every process of ``procs`` on ``node`` (the caller's node) has exited,
    at most ``timeout_s`` seconds in all. Processes on other nodes cannot be watched from
    here and are not waited for; None entries are skipped. Ray returns from ``ray.kill``
    before the process is gone, and callers that unlink or count processes next need
    it gone."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        while proc is not None and proc.node == node and proc.alive() and time.monotonic() < deadline:
            time.sleep(0.02)

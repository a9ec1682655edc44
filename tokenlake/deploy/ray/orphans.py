"""A pool on Ray that outlives its driver (docs/deploy-ray.md "When the driver dies").

A pool with a name (``RayOptions.name``) is made of *detached*, *named* Ray objects: its
placement group ``tokenlake-<name>`` and, per instance, the actors
``tokenlake-<name>-<role>-<instance>`` in the :data:`NAMESPACE` namespace. Ray keeps
them when the driver dies, so a new driver (``tokenlake serve --ray`` on the same control
port) finds them by name and adopts them.

Liveness goes the other way by heartbeats: the driver calls ``beat`` on every actor each
:data:`BEAT_S` (:class:`Heartbeat`); an actor that hears none for
:data:`DRIVER_TIMEOUT_S` takes the driver for dead. Its engine then drops every plan
and session and waits ``orphan_grace_s`` for an ``ADOPT``
(:mod:`tokenlake.engines.owner`); its host waits as long (:class:`Grace`) and,
not adopted, unlinks the instance's buffers, removes the placement group and ends. Both
need a Ray cluster that outlives the driver (``ray start --head``): a Ray started inside
the driver dies with it, and the pool with it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable

import ray

log = logging.getLogger(__name__)

#: the Ray namespace of every named pool's placement group and actors
NAMESPACE = "tokenlake"
#: seconds between two heartbeats of the driver
BEAT_S = 0.5
#: seconds without a heartbeat after which an actor takes its driver for dead (a new
#: driver's adoption waits until its actors have noticed: while they hear the old one,
#: they refuse it)
DRIVER_TIMEOUT_S = 5.0


def group_name(pool: str) -> str:
    """The placement group of pool ``pool``."""
    return f"tokenlake-{pool}"


def actor_name(pool: str, role: str, instance: int) -> str:
    """The actor of ``role`` of ``instance`` in pool ``pool``."""
    return f"tokenlake-{pool}-{role}-{instance}"


def named(pool: str | None, role: str, instance: int) -> dict:
    """The ``.options()`` that make an actor of pool ``pool`` named and detached (none
    for a pool without a name)."""
    if pool is None:
        return {}
    return {"name": actor_name(pool, role, instance), "namespace": NAMESPACE, "lifetime": "detached"}


class Heartbeat:
    """The driver's thread that calls ``beat`` on the actors ``actors()`` returns, every
    :data:`BEAT_S`; answers are collected so no failure goes unread (a dead actor's
    failed call is the watcher's business, not this thread's)."""

    def __init__(self, actors: Callable[[], Iterable]) -> None:
        self._actors = actors
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenlake-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def _run(self) -> None:
        refs: list = []
        while not self._stop.wait(BEAT_S):
            try:
                refs += [a.beat.remote() for a in list(self._actors())]
                done, refs = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
                for ref in done:
                    with contextlib.suppress(Exception):
                        ray.get(ref, timeout=0)
                refs = refs[-1000:]  # a silent actor's calls are not kept forever
            except Exception as exc:  # noqa: BLE001 - Ray shutting down: stop beating
                log.debug("heartbeat: %s", exc)
                if not ray.is_initialized():
                    return


def driver_id() -> str:
    """Who the calling driver is: its Ray node and pid."""
    import os

    return f"{ray.get_runtime_context().get_node_id()}:{os.getpid()}"


class Grace:
    """An actor's view of its driver: :meth:`beat` (the driver is alive), :meth:`adopt`
    (a new driver takes over), and :meth:`watch`, a thread that calls ``give_up`` once the
    driver has been silent for :data:`DRIVER_TIMEOUT_S` and no adoption came within
    ``grace_s`` after that."""

    def __init__(self) -> None:
        self.last_beat = time.monotonic()
        self.silent_since: float | None = None
        self.driver = ""  # who adopted this actor last
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    def alive(self) -> bool:
        return time.monotonic() - self.last_beat < DRIVER_TIMEOUT_S

    def adopt(self, driver: str) -> bool:
        """A driver takes over: False (refused) while another one's heartbeats arrive."""
        if driver != self.driver and self.alive():
            return False
        self.driver = driver
        self.beat()
        self.silent_since = None
        return True

    def watch(self, grace_s: float, give_up: Callable[[], None], what: str) -> None:
        if self._thread is not None or grace_s <= 0:
            return
        self.beat()

        def run() -> None:
            while True:
                time.sleep(0.25)
                now = time.monotonic()
                if self.alive():
                    continue
                if self.silent_since is None or self.silent_since < self.last_beat:
                    self.silent_since = now
                    log.warning("%s: the driver is silent; waiting %.0f s to be adopted", what, grace_s)
                elif now - self.silent_since > grace_s:
                    log.warning("%s: not adopted within %.0f s; it ends", what, grace_s)
                    give_up()
                    return

        self._thread = threading.Thread(target=run, name="tokenlake-grace", daemon=True)
        self._thread.start()


def end_pool(pool: str, instance: int, instances: int, state_file: str | None) -> None:
    """The last of a host's duties when no driver adopted pool ``pool``: the lowest-
    numbered host still there waits (10 s at most) until the other hosts have ended
    (each unlinks its buffers first), then removes the state file and the placement
    group (which ends this actor as well); the others leave that to it."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    from tokenlake.dataplane import pool_state

    def hosts(indices) -> list[int]:
        out = []
        for i in indices:
            with contextlib.suppress(Exception):  # gone: ValueError
                ray.get_actor(actor_name(pool, "host", i), namespace=NAMESPACE)
                out.append(i)
        return out

    if hosts(range(instance)):
        return  # a lower host removes the group
    deadline = time.monotonic() + 10.0
    while hosts([i for i in range(instances) if i != instance]) and time.monotonic() < deadline:
        time.sleep(0.2)
    # the files first: removing the group ends this actor too, before its next line
    with contextlib.suppress(Exception):  # a malformed file must not keep the group
        pool_state.forget(state_file, pool)
    with contextlib.suppress(Exception):  # removed already
        remove_placement_group(get_placement_group(group_name(pool)))

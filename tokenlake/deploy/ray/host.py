"""The host actor: owner of one instance's shared buffers on the instance's node.

The driver cannot create ``/dev/shm`` files on another machine, so each instance's host
actor creates them where the instance runs and unlinks them when it is closed. Names
carry the host's pid (``tokenlake-<pid>-<hex>-<buffer>-<instance>``), so
``tokenlake.dataplane.shm_files.sweep_stale()`` run on a node removes what a killed host left
there. The host never maps its buffers (engines and clients attach by name): it creates
them with the torch-free ``tokenlake.dataplane.shm_files.create_buffer``, so it stays a
small process without torch.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tokenlake.core.errors import EngineUnavailable, NotAuthorized
from tokenlake.dataplane.shm_files import (
    cluster_prefix,
    create_buffer,
    new_cluster_id,
    unlink_buffer,
    unlink_prefix,
)
from tokenlake.deploy.base import BufferLayout
from tokenlake.deploy.ray.liveness import ProcessRef
from tokenlake.deploy.ray.orphans import Grace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostBuffers:
    """What a host created for its instance (returned to the driver through Ray).

    Attributes:
        buffers: ``{name: BufferSpec.to_dict()}`` of the instance's buffers.
        prefix: their common name prefix on the node.
        cluster_id: the host's cluster id (``<pid>-<hex>``; the engines' ``EngineSpec``).
        proc: the host's process.
    """

    buffers: dict[str, dict[str, Any]]
    prefix: str
    cluster_id: str
    proc: ProcessRef


class InstanceHost:
    """Owner of one instance's shared buffers on its node (runs as a Ray actor)."""

    def __init__(self, instance: int) -> None:
        self.instance = instance
        self.cluster_id = new_cluster_id()  # carries this process's pid: sweep_stale works
        self.prefix = cluster_prefix(self.cluster_id)
        self._names: list[str] = []
        self._made: HostBuffers | None = None
        self._grace = Grace()  # the driver's heartbeats (orphans.py)
        atexit.register(self.close)

    def create(self, layout: BufferLayout) -> HostBuffers:
        """Creates the buffers of ``layout`` (all of them, or none: a failure unlinks
        what was made and re-raises)."""
        specs = {}
        try:
            for name, spec in layout.specs(self.prefix, self.instance).items():
                create_buffer(spec.name, spec.nbytes)  # not mapped: the host loads no torch
                self._names.append(spec.name)
                specs[name] = spec.to_dict()
        except BaseException:
            self.close()
            raise
        self._made = HostBuffers(specs, self.prefix, self.cluster_id, ProcessRef.this())
        return self._made

    def create_session(self, layout: BufferLayout, session: int) -> dict[str, dict[str, Any]]:
        """Creates client session ``session``'s buffers on this node
        (:meth:`BufferLayout.session_specs`); returns their spec dicts."""
        specs = layout.session_specs(self.prefix, session, self.instance)
        made = []
        try:
            for spec in specs.values():
                create_buffer(spec.name, spec.nbytes)
                made.append(spec.name)
        except BaseException:
            for name in made:
                unlink_buffer(name)
            raise
        self._names.extend(made)
        return {name: spec.to_dict() for name, spec in specs.items()}

    def drop_session(self, layout: BufferLayout, session: int) -> None:
        """Unlinks client session ``session``'s buffers (idempotent)."""
        for spec in layout.session_specs(self.prefix, session, self.instance).values():
            unlink_buffer(spec.name)
            unlink_prefix(f"{spec.name}.")  # a bell's doorbells (a crashed client's FIFO)
            if spec.name in self._names:
                self._names.remove(spec.name)

    def alive(self) -> bool:
        return True

    # --------------------------------------------- outliving the driver (orphans.py)
    @ray.method(concurrency_group="beat")
    def beat(self) -> None:
        self._grace.beat()

    def watch(self, grace_s: float, pool: str, state_file: str | None, instances: int) -> None:
        """Outlives a driver that dies by ``grace_s`` seconds; not adopted by then,
        unlinks the buffers and ends; the lowest-numbered host still there waits (10 s at
        most) for the other hosts of pool ``pool`` (``instances``) to end, then removes,
        on the driver's machine, the state file, and the placement group (which would
        kill them before they unlinked theirs, and ends this host too)."""

        def give_up() -> None:
            from tokenlake.deploy.ray.orphans import end_pool

            self.close()
            end_pool(pool, self.instance, instances, state_file)
            ray.actor.exit_actor()

        self._grace.watch(grace_s, give_up, repr(self))

    def adopt(self, driver: str) -> HostBuffers:
        """A new driver takes over (refused while another driver's heartbeats arrive):
        what this host made for its instance. The dead driver's client sessions' buffers
        go (the new one numbers its sessions afresh)."""
        if self._made is None:
            raise EngineUnavailable(f"{self!r} has no buffers to hand over")
        if not self._grace.adopt(driver):
            raise NotAuthorized(f"{self!r}: its driver is alive (its heartbeats arrive)")
        mine = {spec["name"] for spec in self._made.buffers.values()}
        for name in [n for n in self._names if n not in mine]:
            unlink_buffer(name)
            self._names.remove(name)
        return self._made

    def close(self) -> int:
        """Unlinks every buffer of this host (idempotent); returns how many it removed."""
        names, self._names = self._names, []
        removed = [n for n in names if unlink_buffer(n)]
        return len(removed) + len(unlink_prefix(self.prefix))

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with this
        return f"tokenlake-host-{self.instance}"


#: ``beat`` has a concurrency group of its own: a busy host still hears its driver.
HostActor = ray.remote(max_restarts=0, concurrency_groups={"beat": 1})(InstanceHost)
_unlink_task = ray.remote(num_cpus=0, max_retries=0)(unlink_prefix)


def unlink_on(node: str, prefix: str, here: str) -> None:
    """Unlinks the buffers under ``prefix`` on ``node`` (for a host that died): directly
    when ``node`` is ``here`` (the caller's node), else by a small Ray task there. A
    failure is logged (``sweep_stale()`` on that node cleans up), never raised."""
    if node == here:
        unlink_prefix(prefix)
        return
    try:
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        ray.get(_unlink_task.options(scheduling_strategy=strategy).remote(prefix), timeout=30.0)
    except RayError as exc:
        log.warning("could not unlink %s* on node %s (%s); run tokenlake.dataplane.shm_files.sweep_stale() there",
                    prefix, node, exc)

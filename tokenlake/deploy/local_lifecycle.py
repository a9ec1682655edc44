"""A local cluster's instances leaving and joining (a mixin of
:class:`~tokenlake.deploy.local.LocalCluster`): the instances with a dead engine, taking
one out, starting it again empty, and the listeners told of an engine's death."""

from __future__ import annotations

import logging
from collections.abc import Callable

from tokenlake.core.errors import ConfigError
from tokenlake.deploy.driver import DriverSockets
from tokenlake.deploy.roles import ENGINE_ROLES as ROLES
from tokenlake.deploy.tier import rejoin

log = logging.getLogger(__name__)


class InstanceLifecycle:
    """Failure detection, removal and restart of instances (see the module docstring)."""

    #: the tier driver's own sockets to the transfer engines, per channel (made on first use)
    _tier_sockets: dict[str, DriverSockets] | None = None

    def _tier_request(self, key, message, reply, channel: str = "reads"):
        """A tier read or fence (:class:`~tokenlake.deploy.tier.TierDriver`), on sockets
        of its own per ``channel``: it may take a while, and the owner's other requests
        (and the other channel's) go on beside it."""
        out = self._tier_request_sockets(channel).exchange([key], message, reply)[key]
        if isinstance(out, BaseException):
            raise out
        return out

    def _tier_stream(self, messages, reply, progress):
        """Tier reads to several transfer engines at once (``{key: message}``), on the
        reads' sockets, their progress messages handed to ``progress(key, message)`` as
        they come: ``{key: reply or its failure}``."""
        return self._tier_request_sockets("reads").exchange(list(messages), messages, reply, progress)

    def _tier_request_sockets(self, channel: str) -> DriverSockets:
        if self._tier_sockets is None:
            self._tier_sockets = {}
        if channel not in self._tier_sockets:
            self._tier_sockets[channel] = DriverSockets(self._dealer, self.timeout_s, dead=self._driver.dead)
        return self._tier_sockets[channel]

    def _close_tier_sockets(self) -> None:
        for sockets in (self._tier_sockets or {}).values():
            sockets.close()
        self._tier_sockets = None

    def failed_instances(self) -> list[int]:
        """Instances in the pool with a dead query or transfer engine (read from the
        processes' sentinels: no waiting)."""
        return [i for i in self.control.instances if self._dead(i) is not None]

    def remove_instance(self, instance: int) -> tuple[str, ...]:
        """Takes ``instance`` out: the other engines forget it, its engines stop, and the
        control plane drops its segments. Returns the requests that lost part of their
        prefix (finish them and compute them again; abort plans in flight first)."""
        from tokenlake.dataplane.messages import Ack, Peers

        self._check_started()
        with self._watch_lock:
            self._leaving.add(instance)  # its engines stop on purpose from here on
        for key in self._live_engines():
            if key[1] != instance:
                self._request(key, Peers(((instance, None),)), Ack)
        for role in ROLES:
            self.kill(role, instance)
        self._driver.forget(instance)
        for sockets in (self._tier_sockets or {}).values():
            sockets.forget(instance)
        client = self._clients.pop(instance, None)
        if client is not None:
            client.close()
        return self.control.remove_instance(instance) if instance in self.control.instances else ()

    def restart_instance(self, instance: int) -> None:
        """A removed instance joins again, empty: new engines on its zeroed buffers, the
        other engines told where they are, and its share of the hash ring back. With a
        disk tier its directory is adopted again (a file its dead writer left half
        written is refused)."""
        from tokenlake.dataplane.messages import Ack, Peers

        self._check_started()
        if instance in self.control.instances:
            raise ConfigError(f"instance {instance} is in the pool: remove it first")
        for (inst, _name), tensor in self._buffers.items():
            if inst == instance:
                tensor.zero_()
        self._spawn(self._specs, [instance])
        with self._watch_lock:
            self._leaving.discard(instance)
            for role in ROLES:
                self.failures.pop((role, instance), None)
        self._watcher.poke()
        for key in self._live_engines():
            if key[1] != instance:
                peer = self._endpoints[(key[0], instance)]
                self._request(key, Peers(((instance, peer),)), Ack)
        self._reopen_sessions(instance)
        rejoin(self.control, instance)
        self.write_state()

    def replace_failed(self, restart: bool = True) -> tuple[str, ...]:
        """Takes every instance with a dead engine out (:meth:`remove_instance`) and,
        with ``restart``, starts it again empty (:meth:`restart_instance`). Returns the
        requests that lost KV there (the caller computes them again). Call it with no
        plan in flight."""
        lost: dict[str, None] = {}
        for instance in self.failed_instances():
            dead = self._dead(instance)
            log.warning("%s died: instance %d leaves the pool%s", dead, instance,
                        " and starts again empty" if restart else "")
            lost.update(dict.fromkeys(self.remove_instance(instance)))
            if restart:
                self.restart_instance(instance)
        return tuple(lost)

    def add_failure_listener(self, listener: Callable[[str, int], None]) -> None:
        """Calls ``listener(role, instance)`` (on the watcher thread; keep it short and do
        not change the cluster there) as soon as an engine dies without being told to:
        killed, crashed, out of memory. Stopping an instance on purpose
        (:meth:`remove_instance`, :meth:`close`) is no failure."""
        self._watcher.listeners.append(listener)

    def _dead(self, instance: int) -> str | None:
        for role in ROLES:
            if not self._procs[(role, instance)].is_alive():
                return f"the {role} engine of instance {instance}"
        return None

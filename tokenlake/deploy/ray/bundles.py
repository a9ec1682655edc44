""":class:`Bundles`: the placement group of a :class:`~tokenlake.deploy.ray.RayCluster`
and the actors of each instance in its bundle, started and torn down together.

Starting a set of instances: every actor is created at once (the engines import torch
while the hosts create the buffers), then the hosts create the buffers, the engines map
them and bind, each new engine learns its peers' endpoints and the running engines learn
the new ones (wire ``PEERS``). Tearing down: the running engines forget the instances
(``PEERS`` with no endpoint), the engines stop, the hosts unlink the buffers (the driver
does it for a dead host), the actors are killed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenlake.core.errors import AdoptionRefused, ConfigError, EngineUnavailable, NotAuthorized
from tokenlake.dataplane.auth import ClusterKeys
from tokenlake.dataplane.shm_files import unlink_prefix
from tokenlake.deploy.base import CLIENT_BUFFERS, ENGINE_BUFFERS, BufferLayout
from tokenlake.deploy.config import engine_fields
from tokenlake.deploy.ray.actors import EngineActorRemote
from tokenlake.deploy.ray.compute import ComputeActors
from tokenlake.deploy.ray.fit import bundles_text, busy_reason, check_fit, cluster_nodes
from tokenlake.deploy.ray.host import HostActor, HostBuffers, unlink_on
from tokenlake.deploy.ray.options import RayOptions
from tokenlake.deploy.ray.orphans import (
    DRIVER_TIMEOUT_S,
    NAMESPACE,
    actor_name,
    driver_id,
    group_name,
    named,
)
from tokenlake.deploy.ray.relay import ActorTable, actor_error, gather
from tokenlake.deploy.roles import ENGINE_ROLES

log = logging.getLogger(__name__)


class Bundles:
    """One placement-group bundle per instance and the actors in each.

    Attributes:
        pg: the placement group (None until :meth:`place`, and after :meth:`remove`).
        node: the driver's Ray node id.
        running: the instances whose engines serve.
        table: the actors' handles, processes and endpoints.
        hosts: per instance, the buffers its host created.
    """

    def __init__(self, options: RayOptions, layout: BufferLayout, timeout_s: float,
                 peer_timeout_s: float, start_timeout_s: float, keys: ClusterKeys | None = None,
                 grant_key: bytes | None = None, config: Any = None) -> None:
        self.options, self.layout, self.keys, self.grant_key = options, layout, keys, grant_key
        self.config = config  # the ClusterConfig: each engine's fields from it (engine_fields)
        self.peer_timeout_s, self.start_timeout_s = peer_timeout_s, start_timeout_s
        self.pg = None
        self.node = ""
        self.running: set[int] = set()
        self.table = ActorTable(timeout_s)
        self.hosts: dict[int, HostBuffers] = {}
        #: a named pool's actors outlive a dead driver by this many seconds (orphans.py)
        self.grace_s = options.orphan_grace_s if options.name is not None else 0.0
        self.state_file: str | None = None  # the driver's state file, removed when they end

    def place(self, n_instances: int) -> None:
        """Places ``n_instances`` bundles of ``options.bundle()``. ``ConfigError`` at once
        when the cluster can never hold them (:func:`~tokenlake.deploy.ray.fit.check_fit`);
        ``EngineUnavailable`` when they fit but Ray could not place them within
        ``options.place_timeout_s`` (others hold the resources)."""
        bundle, strategy = self.options.bundle(), self.options.strategy
        self.node = ray.get_runtime_context().get_node_id()
        nodes = cluster_nodes()
        log.info("placing %s (%s) on the Ray cluster's %d alive node(s)",
                 bundles_text(n_instances, bundle), strategy, len(nodes))
        check_fit(n_instances, bundle, strategy, ray.cluster_resources(), nodes)
        t0 = time.monotonic()
        pool = self.options.name
        self.pg = placement_group([dict(bundle) for _ in range(n_instances)], strategy=strategy,
                                  **({} if pool is None else {"name": group_name(pool), "lifetime": "detached"}))
        ready, _ = ray.wait([self.pg.ready()], timeout=self.options.place_timeout_s)
        if not ready:  # a node may have left since the check: that reason first
            check_fit(n_instances, bundle, strategy, ray.cluster_resources(), cluster_nodes())
            raise EngineUnavailable(busy_reason(n_instances, bundle, strategy, self.options.place_timeout_s,
                                                ray.available_resources(), ray.cluster_resources()))
        log.info("placed %s in %.1f s", bundles_text(n_instances, bundle), time.monotonic() - t0)

    def in_bundle(self, instance: int) -> PlacementGroupSchedulingStrategy:
        """The scheduling strategy of ``instance``'s bundle."""
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=instance)

    # ---------------------------------------------------------------- start
    def start(self, instances: list[int], compute: ComputeActors | None) -> None:
        """Starts the host and engines of ``instances`` (and their compute actors) and
        joins them to the running ones."""
        hosts, engines = self._create_actors(instances)
        if compute is not None:
            compute.create({i: self.in_bundle(i) for i in instances})
        self._create_buffers(hosts)
        self._start_engines(engines)
        others = sorted(self.running)
        self.running |= set(instances)
        self._connect(engines, instances, others)
        if self.grace_s:  # the hosts outlive a dead driver as long as the engines do
            n = len(self.running)
            gather({i: h.watch.remote(self.grace_s, self.options.name, self.state_file, n)
                    for i, h in hosts.items()}, "host watch", self.start_timeout_s)
        if compute is not None:
            compute.open({i: self.client_info(i) for i in instances})

    def _create_actors(self, instances: list[int]) -> tuple[dict[int, Any], dict[tuple[str, int], Any]]:
        hosts, engines = {}, {}
        for i in instances:
            log.info("starting instance %d's host and engines", i)
            pool = self.options.name
            hosts[i] = HostActor.options(scheduling_strategy=self.in_bundle(i), **named(pool, "host", i),
                                         **self.options.resources("host")).remote(i)
            self.table.actors[("host", i)] = hosts[i]
            for role in ENGINE_ROLES:
                actor = EngineActorRemote.options(scheduling_strategy=self.in_bundle(i), **named(pool, role, i),
                                                  **self.options.resources(role)).remote(role, i)
                self.table.actors[(role, i)] = engines[(role, i)] = actor
        return hosts, engines

    def _create_buffers(self, hosts: dict[int, Any]) -> None:
        """Has each host create its instance's buffers; refuses a loopback bind when
        the instances turn out to span several nodes."""
        made = gather({i: h.create.remote(self.layout) for i, h in hosts.items()}, "host start-up",
                      self.start_timeout_s)
        for i, info in made.items():
            self.hosts[i] = info
            self.table.procs[("host", i)] = info.proc
        nodes = {self.table.procs[("host", i)].node for i in set(hosts) | self.running}
        if len(nodes) > 1 and self.options.loopback:
            raise ConfigError(
                f"the instances are on {len(nodes)} nodes but the engines would bind "
                f"{self.options.host}: bind an address the nodes can reach (host='node', an "
                "interface name or an IP; see docs/deploy-ray.md)")

    def _start_engines(self, engines: dict[tuple[str, int], Any]) -> None:
        """Has each engine map its buffers and bind its socket; records the endpoints."""
        from tokenlake.engines.loop import EngineSpec  # imports torch (the engine loop)

        starts = {}
        for (role, i), actor in engines.items():
            info = self.hosts[i]
            spec = EngineSpec(role, i, info.cluster_id, {n: info.buffers[n] for n in ENGINE_BUFFERS[role]},
                              host=self.options.host, peer_timeout_s=self.peer_timeout_s,
                              port_range=self.options.port_range,
                              # the actor relays the driver's requests: it speaks as the owner
                              keys=None if self.keys is None
                              else self.keys.engine_view(with_owner=True).to_dict(),
                              grant_key=self.grant_key, orphan_grace_s=self.grace_s,
                              **({} if self.config is None else engine_fields(self.config, role, i)))
            starts[(role, i)] = actor.start.remote(spec.to_bytes())
        for key, started in gather(starts, "engine start-up", self.start_timeout_s).items():
            self.table.endpoints[key] = started.endpoint
            self.table.procs[key] = started.proc
            log.info("instance %d's %s engine bound %s (pid %d)", key[1], key[0], started.endpoint,
                     started.proc.pid)

    def _connect(self, engines: dict[tuple[str, int], Any], instances: list[int], others: list[int]) -> None:
        """Gives the new engines the endpoints of every running peer (they start serving),
        and the engines of ``others`` those of the new ones."""
        from tokenlake.dataplane.messages import Ack, Peers  # imports torch: only once asked

        table = {role: {j: self.table.endpoints[(role, j)] for j in self.running} for role in ENGINE_ROLES}
        gather({k: a.connect.remote(table[k[0]]) for k, a in engines.items()}, "engine connect",
               self.start_timeout_s)
        for role in ENGINE_ROLES:
            peers = Peers(tuple((i, table[role][i]) for i in instances))
            self.table.request_all([(role, j) for j in others], peers, Ack, strict=True)
        for i in instances:
            log.info("instance %d ready on node %s", i, self.table.procs[("host", i)].ip)

    def adopt(self, n_instances: int) -> None:
        """Takes over the named pool's placement group and actors that a dead driver
        left waiting (:mod:`~tokenlake.deploy.ray.orphans`): every host hands over its
        buffers, every engine hears ``ADOPT``. ``EngineUnavailable`` when one is gone."""
        from ray.util.placement_group import get_placement_group

        pool = self.options.name
        self.node = ray.get_runtime_context().get_node_id()
        try:
            self.pg = get_placement_group(group_name(pool))
            for i in range(n_instances):
                for role in ("host", *ENGINE_ROLES):
                    self.table.actors[(role, i)] = ray.get_actor(actor_name(pool, role, i), namespace=NAMESPACE)
        except ValueError as exc:
            self.table.clear()
            self.pg = None
            raise EngineUnavailable(f"pool {pool!r} is not (all) on Ray any more: {exc}") from None
        answers = self._adopt_actors(list(self.table.actors))
        for (role, i), answer in answers.items():
            if role == "host":
                self.hosts[i] = answer
                self.table.procs[("host", i)] = answer.proc
            else:
                self.table.endpoints[(role, i)], self.table.procs[(role, i)] = answer.endpoint, answer.proc
        self.running = set(range(n_instances))

    def _adopt_actors(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], Any]:
        """Has every actor of ``keys`` adopted by this driver; an actor that still hears
        the old driver refuses until it has been silent :data:`DRIVER_TIMEOUT_S` (a driver
        restarted faster than that waits for it)."""
        import os

        me, deadline, out = driver_id(), time.monotonic() + DRIVER_TIMEOUT_S + 5.0, {}
        while True:
            left = [k for k in keys if k not in out]
            refs = {k: (self.table.actors[k].adopt.remote(me) if k[0] == "host" else
                        self.table.actors[k].adopt.remote(me, os.getpid(), self.grant_key)) for k in left}
            refused = []
            for k, ref in refs.items():
                try:
                    out[k] = ray.get(ref, timeout=self.start_timeout_s)
                except RayError as exc:
                    if not isinstance(actor_error(exc), NotAuthorized):
                        raise EngineUnavailable(f"adopting the {k[0]} actor of instance {k[1]}: "
                                                f"{actor_error(exc)}") from None
                    if time.monotonic() > deadline:  # another driver serves it: leave it be
                        raise AdoptionRefused(f"pool {self.options.name!r}: its actors still hear "
                                              f"a driver after {DRIVER_TIMEOUT_S + 5:.0f} s") from None
                    refused.append(k)
            if not refused:
                return out
            log.info("%d actors still hear the old driver: waiting for them to notice", len(refused))
            time.sleep(0.5)

    def client_info(self, instance: int) -> dict[str, Any]:
        """See :meth:`RayCluster.client_info` (``instance`` must be running)."""
        info, t = self.hosts[instance], self.table
        return {
            "instance": instance,
            "node_id": t.procs[("host", instance)].node,
            "endpoints": {role: t.endpoints[(role, instance)] for role in ENGINE_ROLES},
            "buffers": {n: info.buffers[n] for n in CLIENT_BUFFERS},
            "procs": {role: t.procs[(role, instance)].to_dict() for role in ENGINE_ROLES},
            "timeout_s": self.table.timeout_s,
            # the owner's compute engines (this driver, its compute actors) use the
            # instance's own buffers: the owner's session (docs/security.md)
            "keys": None if self.keys is None else self.keys.owner_client_view().to_dict(),
        }

    # ---------------------------------------------------------------- stop
    def teardown(self, instances: list[int], tell_peers: bool) -> None:
        """Stops and removes the actors of ``instances``; unlinks their buffers.
        ``tell_peers``: the running engines forget them first (drop their sockets and
        what those queued)."""
        from tokenlake.dataplane.messages import Ack, Peers  # imports torch: only once asked

        gone = set(instances)
        self.running -= gone
        if tell_peers and self.running:
            forget = Peers(tuple((i, None) for i in instances))
            for role in ENGINE_ROLES:
                keys = [(role, j) for j in sorted(self.running)]
                self.table.request_all(keys, forget, Ack, strict=False)
        keys = [k for k in self.table.actors if k[1] in gone]
        self.table.stop([k for k in keys if k[0] != "host"])
        unlinked = self._close_hosts(instances)
        self.table.kill(keys, self.node)
        for i in instances:
            info = self.hosts.pop(i, None)
            if info is not None and i not in unlinked:  # the host died: unlink for it
                unlink_on(self.table.procs[("host", i)].node, info.prefix, self.node)
        self.table.forget(keys)

    def _close_hosts(self, instances: list[int]) -> set[int]:
        """Has the hosts of ``instances`` unlink their buffers (at most 5 s); returns the
        instances whose host did."""
        closes = {i: self.table.actors[("host", i)].close.remote()
                  for i in instances if ("host", i) in self.table.actors}
        ready = ray.wait(list(closes.values()), num_returns=len(closes), timeout=5.0)[0] if closes else []
        unlinked = set()
        for i, ref in closes.items():
            if ref in ready:
                with contextlib.suppress(RayError):
                    ray.get(ref)
                    unlinked.add(i)
        return unlinked

    def close(self) -> None:
        """Tears every instance down and removes the placement group. After Ray has shut
        down (which killed the actors), unlinks the buffers on this node only."""
        if ray.is_initialized():
            instances = sorted({i for _, i in self.table.actors} | self.running)
            if instances:
                self.teardown(instances, tell_peers=False)
            if self.pg is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(self.pg)
        else:
            for i, info in self.hosts.items():
                if self.table.procs[("host", i)].node == self.node:
                    unlink_prefix(info.prefix)
            self.hosts.clear()
            self.table.clear()
            self.running.clear()
        self.pg = None

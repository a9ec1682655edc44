""":class:`RayCluster`: the pool's engines as Ray actors, with the client API of ``LocalCluster``.

    import ray
    from tokenlake.deploy.config import ClusterConfig
    from tokenlake.deploy.ray import RayCluster, RayOptions

    ray.init(address="auto")
    config = ClusterConfig(4, load_model("smollm2-135m"), pool_bytes=256 << 20, host="node")
    with RayCluster(config, options=RayOptions(host="node", strategy="STRICT_SPREAD")) as cluster:
        plans = cluster.control.gen_plans(batches, dops)
        ...                                   # exactly as with LocalCluster

Layout. One placement group with one bundle per instance (``RayOptions.strategy``). Each
bundle holds its instance's host actor (its buffers, :mod:`~tokenlake.deploy.ray.host`),
query and transfer engine actors (:mod:`~tokenlake.deploy.ray.actors`) and, once
started, its compute actor (:mod:`~tokenlake.deploy.ray.compute`), so they share a node.

Addresses. Engines bind one ROUTER socket each on ``RayOptions.host`` within
``RayOptions.port_range`` when given, and report the bound endpoint; the driver hands
every engine the endpoints of its peers, and sends the running engines a ``PEERS``
message when an instance leaves or comes back. Tensors never go through Ray; the driver
reaches the engines through their actors only (:mod:`~tokenlake.deploy.ray.relay`).

Failures. A dead engine is seen by clients as ``EngineUnavailable`` (they check the
engine's pid and start time on the node, :mod:`~tokenlake.deploy.ray.liveness`).
``remove_instance(i)`` (or ``remove_failed()``) takes the instance out of the data plane
and the control plane (its segments leave the tree); ``restart_instance(i)`` starts it
again in the same bundle with an empty slab.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
import zmq
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenlake.core.errors import ConfigError, EngineUnavailable
from tokenlake.dataplane.shm import SharedTensor
from tokenlake.dataplane.shm_files import BufferSpec
from tokenlake.deploy.base import ClusterBase
from tokenlake.deploy.config import ClusterConfig
from tokenlake.deploy.ray.adopting import RayAdoptable
from tokenlake.deploy.ray.bundles import Bundles
from tokenlake.deploy.ray.client import open_client
from tokenlake.deploy.ray.compute import ComputeActors, RayComputeEngine
from tokenlake.deploy.ray.liveness import ProcessRef
from tokenlake.deploy.ray.options import ALL_ROLES, COMPUTE_ROLE, RayOptions, with_options
from tokenlake.deploy.roles import ENGINE_ROLES
from tokenlake.deploy.tier import rejoin

log = logging.getLogger(__name__)


class RayCluster(RayAdoptable, ClusterBase):
    """N instances' query and transfer engines as Ray actors, plus the control plane.

    The same API as :class:`tokenlake.deploy.local.LocalCluster` (``control``, ``client``,
    ``slab``, ``replicate``, ``migrate``, ``engine_stats``, ``alive``, ``kill``,
    ``close``, context manager), plus the lifecycle of instances
    (``failed_instances``, ``remove_instance``, ``remove_failed``,
    ``restart_instance``) and what a multi-node deployment needs (``client_info``,
    ``scheduling_strategy``, ``describe``). Roles of :meth:`alive` and :meth:`kill` are
    ``"query"``, ``"transfer"``, ``"host"`` and, once started, ``"compute"``.

    Compute engines: :meth:`start_compute` (or ``compute=True``) starts one
    :class:`~tokenlake.deploy.ray.ComputeActor` per instance in its bundle;
    :meth:`compute_engine` is the driver-side :class:`RayComputeEngine` that ``GenerationLoop``
    uses (it picks it by itself). They are stopped with their instance and restarted
    with it.

    Two forms, as ``LocalCluster``'s: ``RayCluster(config, options=..., compute=...)``
    with a :class:`~tokenlake.deploy.config.ClusterConfig`, or, for convenience, its
    fields (``RayCluster(4, model, pool_bytes, segment_tokens=64, options=...)``).
    Where the engines bind and whether CURVE is off are ``options.host`` and
    ``options.insecure``: the convenience form takes them from ``options``; a
    ``ClusterConfig`` without ``options`` gives its own ``host`` and ``insecure`` to a
    default :class:`RayOptions`, and with ``options`` must agree with them
    (``ConfigError`` otherwise). ``start_timeout_s`` (``None``: 120 s) bounds starting the
    actors, ``options.place_timeout_s`` placing the bundles. The buffers are CPU shared
    memory of the ``tokenlake`` KV layout (other ``device``, ``kv_layout``: ``ConfigError``);
    ``share_slabs`` is not honoured (the instances may be on several nodes).

    Args of this launcher alone: ``options`` (:class:`RayOptions`); ``compute``: start
    the compute actors in :meth:`start` (``True``: with the default weights; a callable:
    their weights loader, see :meth:`start_compute`); ``state_file``: where a named
    pool's state is kept for a new driver to adopt (docs/deploy-ray.md "When the driver
    dies"); ``clock``: the control plane's injected clock.
    """

    def __init__(
        self,
        config: ClusterConfig | int,
        *args: Any,
        options: RayOptions | None = None,
        compute: bool | Callable[[], Any] = False,
        state_file: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        **fields: Any,
    ) -> None:
        config, options = with_options(config, args, fields, options)
        super().__init__(config, clock=clock)
        self.options = options
        self._owns_ray = False
        self._bundles = Bundles(options, self.layout, self.timeout_s, self.peer_timeout_s,
                                self.start_timeout_s, self.keys, self.grant_key, config)
        self._clients: dict[int, Any] = {}
        self._slabs: dict[int, Any] = {}
        self._compute_at_start = compute
        self._compute: ComputeActors | None = None  # once started
        # outliving the driver (adopting.py): a named pool's state file, heartbeats, records
        self.state_file = None if state_file is None else str(state_file)
        self._bundles.state_file = self.state_file
        self._heartbeat = None
        self._record_maps: dict[int, Any] = {}
        self._leftovers: set[str] = set()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Places the bundles, starts 3N actors, exchanges addresses; waits until ready.
        Bundles the Ray cluster can never hold are a ``ConfigError`` before anything is
        placed; bundles that fit but stay unplaced for ``options.place_timeout_s`` (the
        resources are busy) an ``EngineUnavailable``. Progress is logged at INFO."""
        t0 = time.monotonic()
        self._ensure_ray()
        atexit.register(self.close)
        self._start_heartbeat()  # from the first actor on: a slow start is no silence
        try:
            self._bundles.place(self.n_instances)
            if self._compute_at_start:  # created with the engines: they load while the pool starts
                loader = None if self._compute_at_start is True else self._compute_at_start
                self._compute = self._compute_actors(loader, None)
            self._bundles.start(list(range(self.n_instances)), self._compute)
            self._ctx = zmq.Context()
            self._attach_records(range(self.n_instances))
            self.adopt_tiers()  # what a disk tier's directories held from before
        except BaseException:
            self.close()
            raise
        self.write_state()
        log.info("pool ready: %d instances on Ray in %.1f s", self.n_instances, time.monotonic() - t0)

    def close(self) -> None:
        """Stops every engine, unlinks every shared buffer on every node, kills every
        actor, removes the placement group (and shuts Ray down if it started it)."""
        self._stop_threads()
        self._forget_state()  # stopped on purpose: nothing to adopt
        self._detach_records(list(self._record_maps))
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._slabs.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._bundles.close()
        self._compute = None
        atexit.unregister(self.close)
        if self._owns_ray:
            self._owns_ray = False
            ray.shutdown()

    def _teardown(self, instances: list[int], tell_peers: bool) -> None:
        """Closes the driver's clients of ``instances``, then their actors and buffers."""
        for i in instances:
            client = self._clients.pop(i, None)
            if client is not None:
                client.close()
            self._slabs.pop(i, None)
        self._detach_records(instances)
        self._bundles.teardown(instances, tell_peers)

    # ---------------------------------------------------------------- usage
    @property
    def instances(self) -> tuple[int, ...]:
        """The running instances."""
        return tuple(sorted(self._bundles.running))

    def client(self, instance: int):
        """The data-plane client of ``instance`` (created on first use; the driver must
        be on the instance's node). After :meth:`restart_instance` ask for it again."""
        self._check_started()
        if instance not in self._clients:
            self._clients[instance] = open_client(self.client_info(instance), self._ctx, self.timeout_s)
        return self._clients[instance]

    def client_info(self, instance: int) -> dict[str, Any]:
        """What :func:`open_client` needs, as plain data (endpoints, buffer specs, the
        engines' processes); valid until the instance is removed or restarted."""
        self._check_running(instance)
        return self._bundles.client_info(instance)

    def scheduling_strategy(self, instance: int) -> PlacementGroupSchedulingStrategy:
        """Ray scheduling strategy of ``instance``'s bundle: give it to the compute-engine
        actor of that instance (it then shares the node, and the GPU when there is one)."""
        self._check_running(instance)
        return self._bundles.in_bundle(instance)

    def node_id(self, instance: int) -> str:
        self._check_running(instance)
        return self._bundles.table.procs[("host", instance)].node

    def buffer_prefix(self, instance: int) -> str:
        """Name prefix of the instance's shared buffers on its node."""
        self._check_running(instance)
        return self._bundles.hosts[instance].prefix

    @property
    def placement_group(self):
        """The placement group of the instances' bundles (None once closed)."""
        return self._bundles.pg

    def processes(self) -> dict[tuple[str, int], ProcessRef]:
        """Every actor's process (role is ``host``, ``query``, ``transfer`` or ``compute``)."""
        return dict(self._bundles.table.procs)

    def describe(self) -> list[dict[str, Any]]:
        """Per running instance: node, address, endpoints, buffer names and pids."""
        out, t = [], self._bundles.table
        for i in self.instances:
            host = t.procs[("host", i)]
            out.append({
                "instance": i, "node_id": host.node, "node_ip": host.ip,
                "endpoints": {role: t.endpoints[(role, i)] for role in ENGINE_ROLES},
                "buffers": sorted(b["name"] for b in self._bundles.hosts[i].buffers.values()),
                "pids": {role: t.procs[(role, i)].pid for role in ALL_ROLES if (role, i) in t.procs},
            })
        return out

    def slab(self, instance: int):
        """The driver's view of an instance's slab (driver on that node only)."""
        self._check_running(instance)
        if instance not in self._slabs:
            if self.node_id(instance) != self._bundles.node:
                raise ConfigError(f"instance {instance}'s slab is on another node")
            spec = BufferSpec.from_dict(self._bundles.hosts[instance].buffers["slab"])
            self._slabs[instance] = SharedTensor.attach(spec).tensor
        return self._slabs[instance]

    def alive(self, role: str, instance: int) -> bool:
        if role not in ALL_ROLES:
            raise ConfigError(f"role must be one of {ALL_ROLES}, got {role!r}")
        proc, actor = self._bundles.table.procs.get((role, instance)), self._bundles.table.actors.get((role, instance))
        if proc is None or actor is None:
            return False
        if proc.node == self._bundles.node:
            return proc.alive()
        try:
            return bool(ray.get(actor.alive.remote(), timeout=self.timeout_s))
        except RayActorError:
            return False
        except GetTimeoutError:
            return True  # busy, not known to be dead

    def kill(self, role: str, instance: int) -> None:
        """Kills one actor (fault injection): ``ray.kill``, then waits until it is gone."""
        if role not in ALL_ROLES:
            raise ConfigError(f"role must be one of {ALL_ROLES}, got {role!r}")
        self._check_running(instance)
        if (role, instance) not in self._bundles.table.actors:
            raise ConfigError(f"instance {instance} has no {role} actor")
        ray.kill(self._bundles.table.actors[(role, instance)], no_restart=True)
        deadline = time.monotonic() + 10.0
        while self.alive(role, instance):
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"the {role} actor of instance {instance} did not die")
            time.sleep(0.02)

    # ------------------------------------------------------- instance lifecycle
    def failed_instances(self) -> list[int]:
        """Running instances with a dead query or transfer engine. (A dead host alone
        does not fail its instance: the engines keep their mappings, and its buffers are
        unlinked by the driver when the instance is removed or the pool closes. Nor does
        a dead compute actor: the slab still serves the pool; see :meth:`restart_compute`.)"""
        return [i for i in self.instances if not all(self.alive(r, i) for r in ENGINE_ROLES)]

    def remove_instance(self, instance: int) -> tuple[str, ...]:
        """Takes an instance out: its peers forget it, its actors stop, its buffers are
        unlinked, and the control plane drops its segments (the ids of requests that
        lost part of their prefix are returned: finish and recompute them; abort plans
        that were in flight)."""
        self._check_running(instance)
        self._teardown([instance], tell_peers=True)
        self._forget_sessions(instance)
        if instance in self.control.instances:  # unless the caller removed it already
            return self.control.remove_instance(instance)
        return ()

    def remove_failed(self) -> dict[int, tuple[str, ...]]:
        """:meth:`remove_instance` for every failed instance: {instance: lost requests}."""
        return {i: self.remove_instance(i) for i in self.failed_instances()}

    def restart_instance(self, instance: int) -> tuple[str, ...]:
        """Brings an instance back in its bundle with an empty slab: new actors (its
        compute actor too, when started), new buffers, new endpoints sent to its peers;
        it rejoins the control plane's ring.
        A running instance is removed first (its lost requests are returned)."""
        if not 0 <= instance < self.n_instances:
            raise ConfigError(f"instance must be in [0, {self.n_instances}), got {instance}")
        if self._bundles.pg is None:
            raise ConfigError("the cluster is not running")
        lost = self.remove_instance(instance) if instance in self._bundles.running else ()
        if instance in self.control.instances:
            lost += self.control.remove_instance(instance)
        try:
            self._bundles.start([instance], self._compute)
        except BaseException:
            self._teardown([instance], tell_peers=True)
            raise
        self._attach_records([instance])
        rejoin(self.control, instance)  # an empty instance joins the ring, with its disk tier
        return lost

    @classmethod
    def default_start_timeout_s(cls, config: ClusterConfig) -> float:
        """120 s: Ray starts a worker per actor, which imports torch."""
        return 120.0

    def _check_running(self, instance: int) -> None:
        if instance not in self._bundles.running:
            raise ConfigError(f"instance {instance} is not running")

    # -------------------------------------------------------------- compute
    def start_compute(self, weights_loader: Callable[[], Any] | None = None,
                      threads: int | None = None) -> None:
        """Starts a :class:`~tokenlake.deploy.ray.ComputeActor` in every running
        instance's bundle (on its node) and waits until each has loaded its weights and
        opened its client.

        ``weights_loader``: a picklable function called once in each actor that returns
        the :class:`~tokenlake.model.llama.weights.LlamaWeights` (default
        ``tokenlake.model.llama.weights.load_weights``, SmolLM2-135M; the cluster's model spec
        must match them). Each actor asks for ``RayOptions.resources("compute")`` (what
        ``engine_share`` leaves of the bundle) and runs torch with ``threads`` threads
        (default: its whole CPUs, at least 1). :meth:`restart_instance` starts the
        instance's compute actor again; :meth:`close` and :meth:`remove_instance` stop it.
        """
        if self._bundles.pg is None:
            raise ConfigError("the cluster is not running")
        if self._compute is not None:
            raise ConfigError("the compute actors are already started")
        self._compute = self._compute_actors(weights_loader, threads)
        try:
            self._start_compute(list(self.instances))
        except BaseException:
            self._compute.stop(list(self.instances), self._bundles.node)
            self._compute = None
            raise

    def restart_compute(self, instance: int) -> None:
        """Replaces the compute actor of a running instance (after it died, say); the
        pool's engines and slab are untouched."""
        self._check_running(instance)
        if self._compute is None:
            raise ConfigError("the compute actors were not started (start_compute)")
        self._compute.stop([instance], self._bundles.node)
        self._start_compute([instance])

    def compute_actor(self, instance: int):
        """The Ray actor handle of ``instance``'s :class:`~tokenlake.deploy.ray.ComputeActor`."""
        actor = self._bundles.table.actors.get((COMPUTE_ROLE, instance))
        if actor is None or instance not in self._bundles.running:
            raise EngineUnavailable(f"instance {instance} has no compute actor (the instance is not "
                                    "running, or start_compute was not called)")
        return actor

    def compute_engine(self, timeout_s: float | None = 300.0) -> RayComputeEngine | None:
        """A :class:`RayComputeEngine` over the compute actors, or None when they were not
        started (``GenerationLoop`` then computes in the driver with :meth:`client`)."""
        return RayComputeEngine(self, timeout_s) if self._compute is not None else None

    def _compute_actors(self, loader: Callable[[], Any] | None, threads: int | None) -> ComputeActors:
        return ComputeActors(self._bundles.table, self.options, loader, threads, self.start_timeout_s)

    def _start_compute(self, instances: list[int]) -> None:
        self._compute.create({i: self._bundles.in_bundle(i) for i in instances})
        self._compute.open({i: self.client_info(i) for i in instances})

    # ------------------------------------------------- client sessions
    def _make_session_buffers(self, session: int, instance: int) -> dict[str, Any]:
        """Has ``instance``'s host create the session's buffers on its node."""
        from tokenlake.dataplane.shm_files import BufferSpec

        host = self._bundles.table.actors[("host", instance)]
        made = ray.get(host.create_session.remote(self.layout, session), timeout=self.timeout_s)
        return {name: BufferSpec.from_dict(d) for name, d in made.items()}

    def _drop_session_buffers(self, session: int, instance: int) -> None:
        host = self._bundles.table.actors.get(("host", instance))
        if host is not None:
            with contextlib.suppress(RayError):
                ray.get(host.drop_session.remote(self.layout, session), timeout=self.timeout_s)

    def _engine_endpoints(self, instance: int) -> dict[str, str]:
        return {role: self._bundles.table.endpoints[(role, instance)] for role in ENGINE_ROLES}

    def _forget_sessions(self, instance: int) -> None:
        """A removed instance's host unlinked its sessions' buffers with its own: its
        sessions there are gone (their clients see ``EngineUnavailable``)."""
        for key in [k for k in self._sessions if k[1] == instance]:
            del self._sessions[key]

    # ------------------------------------------------- the driver's requests
    def _live_engines(self) -> list[tuple[str, int]]:
        return [(r, i) for i in self.instances for r in ENGINE_ROLES if self.alive(r, i)]

    def _request(self, key, message, reply):
        return self._bundles.table.request(key, message, reply)

    def _request_all(self, keys, message, reply):
        """All at once through the actors; an engine that fails is logged and left out."""
        return self._bundles.table.request_all(keys, message, reply, strict=False)


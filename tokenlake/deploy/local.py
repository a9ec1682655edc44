"""``LocalCluster``: the query and transfer engines of N instances on this machine.

    config = ClusterConfig(4, load_model("smollm2-135m"), pool_bytes=64 << 20)
    with LocalCluster(config) as cluster:    # or LocalCluster(4, model, pool_bytes=64 << 20)
        plans = cluster.control.gen_plans(batches, dops)
        client = cluster.client(plans.query_plans[0].home)
        ...

The cluster process is the driver: it runs the control plane and owns every shared
buffer (created here, unlinked in :meth:`LocalCluster.close`, also when an engine
crashed). A watcher thread waits on every engine's process sentinel: an engine that dies
is known within milliseconds (:meth:`LocalCluster.add_failure_listener`,
:meth:`LocalCluster.replace_failed`), without waiting for a request to time out.
Engines are started with the ``forkserver`` method, which imports torch once (with the
engines' OpenMP settings, ``OPENMP_ENV``, where the caller set none), and stop when told
to or when this process dies: each engine watches the launcher's pid
(``EngineSpec.owner_pid``) and, once it is gone (even by ``kill -9``), stops within
0.1 s and unlinks the cluster's buffers; a new cluster also sweeps the buffers of
launchers that are gone (``sweep_stale``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import torch
import zmq

from tokenlake.core.errors import ConfigError, EngineUnavailable
from tokenlake.dataplane import pool_state
from tokenlake.dataplane.auth import connect_secure
from tokenlake.dataplane.client import InstanceClient
from tokenlake.dataplane.messages import Shutdown, WireMessage
from tokenlake.dataplane.shm import BufferRegistry, SharedTensor
from tokenlake.dataplane.shm_files import (
    BufferSpec,
    cluster_prefix,
    new_cluster_id,
    sweep_stale,
    unlink_prefix,
)
from tokenlake.dataplane.sockets import send_frames
from tokenlake.deploy.adoption import Adoptable
from tokenlake.deploy.base import CLIENT_BUFFERS, ENGINE_BUFFERS, ClusterBase, Reply
from tokenlake.deploy.config import ClusterConfig, engine_fields
from tokenlake.deploy.driver import DriverSockets, ended_in
from tokenlake.deploy.local_lifecycle import InstanceLifecycle
from tokenlake.deploy.roles import ENGINE_ROLES as ROLES
from tokenlake.deploy.roles import engine_entry
from tokenlake.deploy.tier import check_host_tiers
from tokenlake.deploy.watcher import EngineWatcher
from tokenlake.engines.loop import EngineSpec
from tokenlake.engines.openmp import OPENMP_ENV

log = logging.getLogger(__name__)

__all__ = ["ClusterConfig", "LocalCluster"]  # the settings with their launcher, for one import


class LocalCluster(InstanceLifecycle, Adoptable, ClusterBase):
    """N instances' query and transfer engines as local processes, plus the control plane.

    Two forms, the same cluster::

        LocalCluster(ClusterConfig(4, model, 64 << 20, segment_tokens=64), query_threads=2)
        LocalCluster(4, model, 64 << 20, segment_tokens=64, query_threads=2)

    The first takes a :class:`~tokenlake.deploy.config.ClusterConfig` (the pool's
    settings, validated when built); the second, for convenience, takes its fields
    (``instances, model, pool_bytes`` and optionally ``segment_tokens, max_rows`` by
    position, any other by name) and builds it (:meth:`ClusterConfig.of
    <tokenlake.deploy.config.ClusterConfig.of>`); :attr:`config` is the result either way.

    Settings (see ``ClusterConfig``): ``host`` is the address the engines bind (loopback
    by default); CURVE is on unless ``insecure``. ``share_slabs`` (default on; honoured
    on a CPU pool): every slab is in this machine's memory, so a query engine attends the
    other instances' slots of its plans itself, through shared memory, instead of asking
    their query engines, and a transfer engine copies a segment (replication, migration)
    straight into the target's slab (docs/data-plane.md "Co-located slabs"); ``False``
    sends all of it by message, as between hosts.

    Args of this launcher alone: ``query_threads``: intra-op threads of each query
    engine (the csrc kernel splits a large query over kv heads and slots; the compute
    engine waits meanwhile), 1 for the transfer engines. ``orphan_grace_s``: how long the
    engines outlive this process waiting to be adopted (0: they stop with it; CPU pools
    only), ``state_file``: where the pool's state is kept for that
    (:mod:`tokenlake.deploy.adoption`, docs/design.md §4 "Restart"). ``clock``: the
    control plane's injected clock.
    """

    shares_slabs = True  # every instance on this machine

    def __init__(
        self,
        config: ClusterConfig | int,
        *args: Any,
        query_threads: int = 2,
        orphan_grace_s: float = 0.0,
        state_file: str | os.PathLike | None = None,
        clock: Callable[[], float] = time.monotonic,
        **fields: Any,
    ) -> None:
        super().__init__(ClusterConfig.of(config, *args, **fields), clock=clock)
        check_host_tiers(self.config)  # every instance is on this machine
        if query_threads < 1:
            raise ConfigError(f"query_threads must be >= 1, got {query_threads}")
        self.query_threads = int(query_threads)
        if not orphan_grace_s >= 0:
            raise ConfigError(f"orphan_grace_s must be >= 0, got {orphan_grace_s}")
        if orphan_grace_s and self.layout.device != "cpu":
            log.warning("a GPU pool cannot be adopted (CUDA IPC memory dies with its creator): "
                        "its engines stop with this process")
            orphan_grace_s = 0.0
        self.orphan_grace_s = float(orphan_grace_s)
        self.state_file = None if state_file is None else str(state_file)
        self._leftovers: set[str] = set()  # files removed with the state file
        self._retired_procs: list = []  # replaced adopted engines (their pidfds close with the cluster)
        self.cluster_id = ""
        self._registry: BufferRegistry | None = None
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._made: dict[tuple[int, str], Any] = {}  # the created BufferSpecs (CUDA: with IPC handles)
        self._session_buffers: dict[tuple[int, int], dict[str, SharedTensor]] = {}  # (session, instance)
        self._procs: dict[tuple[str, int], mp.Process] = {}
        self._endpoints: dict[tuple[str, int], str] = {}
        self._clients: dict[int, InstanceClient] = {}
        self._watcher = EngineWatcher(self._procs)  # reports an engine's death at once
        #: ``(role, instance) -> time.monotonic()`` when its engine was seen dead
        self.failures = self._watcher.failures
        self._watch_lock = self._watcher.lock
        self._leaving = self._watcher.leaving  # instances whose engines are stopped on purpose
        # the owner's requests; an engine whose process ended (a look, no message) is not waited for
        self._driver = DriverSockets(self._dealer, self.timeout_s, dead=ended_in(self._procs))

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Creates the shared buffers and starts 2N engine processes; waits until ready."""
        sweep_stale()  # buffers of launchers that died without closing (kill -9)
        self.cluster_id = new_cluster_id()
        self._registry = BufferRegistry(cluster_prefix(self.cluster_id))
        try:
            specs = self._create_buffers()
            self._spawn(specs)
        except BaseException:
            self.close()
            raise
        self._ctx = zmq.Context()
        self._watcher.start()
        self.write_state()
        try:
            self.adopt_tiers()
        except BaseException:
            self.close()
            raise

    def _create_buffers(self) -> dict[int, dict[str, dict]]:
        """Creates every instance's buffers (``self.layout``); their spec dicts per instance."""
        out: dict[int, dict[str, dict]] = {}
        for inst in range(self.n_instances):
            for name, spec in self.layout.specs(self._registry.prefix, inst).items():
                made = self._registry.create(spec)  # a CUDA buffer's spec gains its IPC handle
                self._buffers[(inst, name)] = made.tensor
                self._made[(inst, name)] = made.spec
            out[inst] = {name: self._made[(inst, name)].to_dict() for name in self.layout.shapes()}
            if (inst, "records") in self._buffers:
                self.records.attach(inst, self._buffers[(inst, "records")])
        return out

    def _spawn(self, specs: dict[int, dict[str, dict]], instances=None) -> None:
        """Starts the engines of ``instances`` (default: all) and hands each the
        endpoints of its role's engines."""
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "tokenlake.engines.query", "tokenlake.engines.transfer"])
        _start_forkserver()
        self._specs = specs
        conns = {}
        for inst in range(self.n_instances) if instances is None else instances:
            for role in ROLES:
                spec = EngineSpec(role, inst, self.cluster_id,
                                  {n: specs[inst][n] for n in ENGINE_BUFFERS[role]},
                                  host=self.host, peer_timeout_s=self.peer_timeout_s,
                                  torch_threads=self.query_threads if role == "query" else 1,
                                  owner_pid=os.getpid(),
                                  keys=None if self.keys is None else self.keys.engine_view().to_dict(),
                                  shared_slabs=self._shared_slabs(specs, role, inst),
                                  grant_key=self.grant_key, orphan_grace_s=self.orphan_grace_s,
                                  state_file=self.state_file, **engine_fields(self.config, role, inst))
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=engine_entry(role), args=(spec.to_bytes(), child),
                                   name=f"tokenlake-{role}-{inst}", daemon=True)
                proc.start()
                child.close()
                with self._watch_lock:
                    old = self._procs.get((role, inst))
                    if old is not None and not isinstance(old, mp.Process):
                        self._retired_procs.append(old)  # the watcher may still poll its fd
                    self._procs[(role, inst)] = proc
                conns[(role, inst)] = parent
        for key, conn in conns.items():
            self._endpoints[key] = self._expect(conn, key)["endpoint"]
        for (role, _inst), conn in conns.items():
            peers = {i: ep for (r, i), ep in self._endpoints.items() if r == role}
            conn.send_bytes(msgpack.packb({"peers": peers}))
        for key, conn in conns.items():
            self._expect(conn, key)
            conn.close()

    def _shared_slabs(self, specs: dict[int, dict[str, dict]], role: str, inst: int) -> dict[int, dict]:
        """The other instances' slabs an engine maps (``share_slabs``): a query engine
        attends their slots, a transfer engine copies segments into them."""
        if not self.share_slabs:
            return {}
        return {other: specs[other]["slab"] for other in range(self.n_instances) if other != inst}

    def _expect(self, conn, key) -> dict:
        deadline = time.monotonic() + self.start_timeout_s
        while not conn.poll(0.1):
            if not self._procs[key].is_alive():
                raise EngineUnavailable(f"{key[0]} engine {key[1]} died during start-up")
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"{key[0]} engine {key[1]} did not start in time")
        try:
            return msgpack.unpackb(conn.recv_bytes(), strict_map_key=False)
        except EOFError:
            raise EngineUnavailable(
                f"{key[0]} engine {key[1]} died during start-up (engines start with the "
                "'forkserver' method: a script that starts a LocalCluster must do so under "
                "`if __name__ == '__main__':`)"
            ) from None

    def close(self) -> None:
        """Stops every engine (politely, then by force) and unlinks every shared buffer."""
        self._watcher.stop()
        if self.cluster_id:  # stopped on purpose: nothing to adopt (if the file is ours)
            pool_state.forget(self.state_file, self.cluster_id, os.getpid())
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._stop_tier_fencing()
        if self._ctx is not None:
            self._driver.close()
            self._close_tier_sockets()
            self._shutdown_engines()
            self._ctx.term()
            self._ctx = None
        for proc in self._procs.values():
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        for proc in [*self._procs.values(), *self._retired_procs]:
            if hasattr(proc, "close") and not isinstance(proc, mp.Process):
                proc.close()  # an adopted engine's pidfd
        self._procs.clear()
        self._retired_procs.clear()
        self._buffers.clear()
        for session, instance in list(self._session_buffers):
            self._drop_session_buffers(session, instance)
        self._sessions.clear()
        if self._registry is not None:
            self._registry.cleanup()
            self._registry = None

    def _shutdown_engines(self) -> None:
        socks = []
        for key in self._endpoints:
            if not self._procs[key].is_alive():
                continue
            sock = self._dealer(key)
            send_frames(sock, Shutdown().encode(0))
            socks.append(sock)
        deadline = time.monotonic() + 2.0
        for sock in socks:
            sock.poll(max(0, int((deadline - time.monotonic()) * 1000)))
            sock.close(0)

    # ---------------------------------------------------------------- usage
    def client(self, instance: int) -> InstanceClient:
        """The data-plane client of ``instance`` (created on first use)."""
        self._check_started()
        if instance not in self._clients:
            bufs = {n: self._buffers[(instance, n)] for n in CLIENT_BUFFERS}
            eps = {role: self._endpoints[(role, instance)] for role in ROLES}
            client = InstanceClient(instance, eps, bufs, lambda: self._dead(instance), self.timeout_s,
                                    keys=self.keys, as_owner=True)
            client.start(self._ctx)
            self._clients[instance] = client
        return self._clients[instance]

    def client_info(self, instance: int) -> dict[str, Any]:
        """What another process of this machine needs to open ``instance``'s client
        (``ControlServer``, ``tokenlake.connect``), as plain data: ``{"instance",
        "endpoints": {role: endpoint}, "buffers": {name: BufferSpec dict}, "timeout_s"}``
        (the client buffers are POSIX shared memory, attachable by name), and ``"keys"``:
        the member's CURVE keys (``None`` if insecure)."""
        self._check_started()
        if not 0 <= instance < self.n_instances:
            raise ConfigError(f"no instance {instance} (the cluster has {self.n_instances})")
        return {"instance": instance,
                "endpoints": {role: self._endpoints[(role, instance)] for role in ROLES},
                "buffers": {n: self._made[(instance, n)].to_dict() for n in CLIENT_BUFFERS},
                "timeout_s": self.timeout_s,
                "keys": None if self.keys is None else self.keys.member_view().to_dict()}

    def mappable_slab(self, instance: int) -> dict | None:
        """A CPU slab is a file in this machine's ``/dev/shm``; a CUDA one is not offered
        (its IPC handle would tie the client to the pool's device)."""
        spec = self._made.get((instance, "slab"))
        return None if spec is None or spec.is_cuda else spec.to_dict()

    # ------------------------------------------------------- client sessions
    def _make_session_buffers(self, session: int, instance: int) -> dict[str, BufferSpec]:
        specs = self.layout.session_specs(self._registry.prefix, session, instance)
        made: dict[str, SharedTensor] = {}
        try:
            for name, spec in specs.items():
                made[name] = SharedTensor.create(spec)  # a CUDA buffer's spec gains its IPC handle
        except BaseException:
            for st in made.values():
                st.close()
                st.unlink()
            raise
        self._session_buffers[(session, instance)] = made
        return {name: st.spec for name, st in made.items()}

    def _drop_session_buffers(self, session: int, instance: int) -> None:
        for st in self._session_buffers.pop((session, instance), {}).values():
            st.close()
            st.unlink()
            if st.spec.name.endswith(f"bell-{instance}"):  # and its doorbells (a crashed client's)
                unlink_prefix(f"{st.spec.name}.")

    def _engine_endpoints(self, instance: int) -> dict[str, str]:
        return {role: self._endpoints[(role, instance)] for role in ROLES}

    def slab(self, instance: int) -> torch.Tensor:
        """The driver's view of an instance's slab (tests and benchmarks read it)."""
        return self._buffers[(instance, "slab")]

    def alive(self, role: str, instance: int) -> bool:
        return self._procs[(role, instance)].is_alive()

    def kill(self, role: str, instance: int) -> None:
        """Kills one engine (fault-injection for tests)."""
        proc = self._procs[(role, instance)]
        proc.kill()
        proc.join(timeout=5.0)

    def _dealer(self, key: tuple[str, int], *, as_owner: bool = True, as_engine: bool = False,
                routing_id: bytes | None = None) -> zmq.Socket:
        """A fresh DEALER connected to one engine, as the owner (or as a member, or as
        another engine; with ``routing_id``, a session's token); the caller closes it."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        connect_secure(sock, self.keys, as_owner=as_owner and not as_engine, as_engine=as_engine)
        sock.connect(self._endpoints[key])
        return sock

    def _request(self, key: tuple[str, int], message: WireMessage, reply: type[Reply]) -> Reply:
        """One request to one engine, and its reply as a ``reply``."""
        out = self._driver.exchange([key], message, reply)[key]
        if isinstance(out, BaseException):
            raise out
        return out

    def _request_all(self, keys: list[tuple[str, int]], message: WireMessage,
                     reply: type[Reply]) -> dict[tuple[str, int], Reply]:
        """The same request to several engines at once; the first failure is raised."""
        out = self._driver.exchange(keys, message, reply)
        for value in out.values():
            if isinstance(value, BaseException):
                raise value
        return out

    def _request_each(self, keys, message, reply):
        """All at once on the driver's sockets (:class:`DriverSockets`)."""
        return self._driver.exchange(keys, message, reply)

    def _live_engines(self) -> list[tuple[str, int]]:
        return [key for key in self._endpoints if self._procs[key].is_alive()]


def _start_forkserver() -> None:
    """Starts the forkserver (if it is not running) with the engines' OpenMP settings
    added to the environment it inherits where the caller's has none, so that every
    engine it forks sleeps its idle OpenMP workers, as under ``tokenlake``; the caller's
    environment is as it was afterwards (other threads may see the two settings while the
    forkserver starts). A forkserver started elsewhere keeps the settings it started with
    (said once in the log)."""
    from multiprocessing import forkserver

    with _FORKSERVER_ENV:
        before = getattr(forkserver._forkserver, "_forkserver_pid", None)
        added = [name for name in OPENMP_ENV if name not in os.environ]
        try:
            os.environ.update({name: OPENMP_ENV[name] for name in added})
            forkserver.ensure_running()  # starts it, or again if it died; else nothing
        finally:
            for name in added:
                os.environ.pop(name, None)
        now = getattr(forkserver._forkserver, "_forkserver_pid", None)
        if now != before:
            _FORKSERVER["ours"] = now
        elif now not in (_FORKSERVER["ours"], _FORKSERVER["said"]):
            _FORKSERVER["said"] = now
            log.info("the forkserver was started elsewhere: engines keep its OpenMP settings")


_FORKSERVER_ENV = threading.Lock()
_FORKSERVER: dict[str, int | None] = {"ours": None, "said": None}  # pids: the one started here, the one logged

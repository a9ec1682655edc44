"""``tokenlake.connect``: the control plane of a served pool, from another process.

    with tokenlake.connect("tcp://127.0.0.1:7400") as cp:
        hit = cp.get_prefix_tree().match(prompt, max_tokens=len(prompt) - 1).hit_tokens
        plans = cp.gen_plans(batches, dops)
        client = cp.client(plans.query_plans[0].home)   # the instance's data-plane client
        ...                                             # init_query / query / init_transfer / put
        cp.complete(plans)

:class:`RemoteControlPlane` has the calls of
:class:`~tokenlake.core.control.ControlPlane` that a compute engine drives, with the same
names, arguments and return types (the core's frozen dataclasses, carried exactly by the
``CP_*`` messages). It needs only the core and the data plane, so a serving framework's
worker imports it without the launchers. Every wait has a timeout: a server that does
not answer raises :class:`~tokenlake.core.errors.EngineUnavailable`, a refused call the
typed exception the server raised (``PlanError``, ``CapacityError``, ``WireError``, ...).
Threads may share one object: its calls are serialised by a lock (the data-plane
clients it opens are for one thread each, as in-process ones are).

The first call that plans, stores or reads opens the object's **session** with the
server (docs/design.md §10): from then on a thread heartbeats every ``heartbeat_s``
the server asks for, the data-plane clients use the session's own buffers, and the
request ids it sends are its own. :meth:`RemoteControlPlane.close` ends the session
(what it left in flight is aborted); a process that dies without closing is ended by
the server once its heartbeats stop (``timeout_s``, 3 s by default). Reading
statistics and matching prefixes need no session.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Sequence

import zmq

from tokenlake.core.control import ControlStats
from tokenlake.core.cost_model import LatencyModel
from tokenlake.core.errors import ConfigError, EngineUnavailable, SessionEnded, TokenLakeError
from tokenlake.core.plans import Batch, Plans
from tokenlake.core.prefix_tree import MatchResult, SegmentLocation
from tokenlake.core.specs import HardwareProfile
from tokenlake.dataplane import wire
from tokenlake.dataplane.auth import ClusterKeys, connect_secure
from tokenlake.dataplane.client import InstanceClient
from tokenlake.dataplane.credentials import load as credentials_load
from tokenlake.dataplane.messages import (
    Ack,
    CpAbort,
    CpCacheLoad,
    CpClientInfo,
    CpClientInfoResult,
    CpCloseSession,
    CpComplete,
    CpFinishRequest,
    CpGenPlans,
    CpHeartbeat,
    CpLeased,
    CpLeasePrefix,
    CpLoad,
    CpMatch,
    CpMatched,
    CpOpenSession,
    CpPlans,
    CpSession,
    CpStats,
    CpStatsResult,
    SessionInfo,
    WireMessage,
    expect,
)
from tokenlake.dataplane.messages.base import M
from tokenlake.dataplane.messages.session import alias, new_token, token_for
from tokenlake.dataplane.segment_reader import SegmentReader
from tokenlake.dataplane.shm import SharedTensor
from tokenlake.dataplane.sockets import send


def connect(address: str, timeout_s: float = 5.0,
            credentials: str | os.PathLike | dict | ClusterKeys | None = None,
            label: str = "", session: str | None = None, connection: int = 0) -> RemoteControlPlane:
    """The control plane served at ``address`` (``"tcp://HOST:PORT"``), connected.

    ``timeout_s`` bounds every wait for the server (seconds). ``credentials``: the file
    ``tokenlake serve`` wrote (or its content, or the keys); by default the one it wrote
    for this port on this machine (:mod:`tokenlake.dataplane.credentials`), and no CURVE if
    there is none. ``label``: what ``tokenlake status`` calls this client's session.
    ``session``: a secret the processes of one client share (each then joins the same
    session, with its own ``connection`` number, 1 to 250: the vLLM connector's scheduler
    and worker); by default the session is this object's alone. Connecting does not
    wait: a server that is not there, or that refuses the keys, shows at the first call,
    as ``EngineUnavailable``.
    """
    keys = credentials_load(credentials, address)
    return RemoteControlPlane(address, timeout_s, keys, label, session, connection).start()


class RemotePrefixTree:
    """The read side of the served pool's prefix tree (``get_prefix_tree()``)."""

    def __init__(self, remote: RemoteControlPlane) -> None:
        self._remote = remote

    def match(self, token_ids: Sequence[int], max_tokens: int | None = None,
              salt: str | None = None) -> MatchResult:
        """Longest prefix of ``token_ids`` made of ready segments stored under cache
        salt ``salt`` (:meth:`~tokenlake.core.prefix_tree.PrefixTree.match`)."""
        request = CpMatch(tuple(int(t) for t in token_ids), max_tokens, salt or None)
        return self._remote._call(request, CpMatched).match


class RemoteControlPlane:
    """A client of a :class:`~tokenlake.service.server.ControlServer` (see the module)."""

    def __init__(self, address: str, timeout_s: float = 5.0, keys: ClusterKeys | None = None,
                 label: str = "", session: str | None = None, connection: int = 0) -> None:
        self.address, self.timeout_s, self.keys, self.label = address, timeout_s, keys, label
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._clients: dict[int, InstanceClient] = {}
        self._readers: list[SegmentReader] = []  # opened by reader() (closed ones dropped at its next call)
        self._attached: list[SharedTensor] = []
        self._in_flight: set[int] = set()  # iterations planned here, not yet completed or aborted
        # the server's grants of this session's plans: id(plan) -> (plan, grant), per iteration
        self._grants: dict[int, tuple[object, bytes]] = {}
        self._granted: dict[int, list[int]] = {}  # iteration -> ids of its plans in _grants
        self._read_grants: dict[tuple[str, int], bytes] = {}  # (request id, instance) -> read grant
        if session is None and connection:
            raise ConfigError("a connection number needs a shared session secret")
        if not 0 <= connection <= 250:
            raise ConfigError(f"connection must be in [0, 250], got {connection}")
        # this object's session (the token) and its connection's routing id to every socket
        self.token = new_token() if session is None else token_for(session)
        self.routing_id = self.token if connection == 0 else alias(self.token, connection)
        self.connection = connection
        self.session: CpSession | None = None  # once opened (the first call that needs it)
        self._beat_stop = threading.Event()
        self._beat: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> RemoteControlPlane:
        """Connects the socket (does not wait for the server); returns ``self``."""
        if self._sock is None:
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
            connect_secure(self._sock, self.keys)
            self._sock.connect(self.address)
        return self

    def close(self) -> None:
        """Ends this object's session (leaves it, when other processes joined it too: the
        last to leave ends it): the server aborts the plans it got and did not complete
        or abort, and finishes its requests (best effort: a server that does not answer
        is given up after one timeout, and ends the session itself once the heartbeats
        stop); closes the data-plane clients, unmaps their buffers and closes the
        socket."""
        self._stop_heartbeat()
        if self.session is not None and self._sock is not None:
            try:  # the server closes it on the engines first, then aborts what is in flight
                self._call(CpCloseSession(), Ack)
            except TokenLakeError:  # ended already, or no server: it ends it by itself
                pass
            self.session = None
        self._in_flight.clear()
        for client in [*self._clients.values(), *self._readers]:
            client.close()
        self._clients.clear()
        self._readers.clear()
        for shared in self._attached:
            shared.close()
        self._attached.clear()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> RemoteControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the control plane
    def get_prefix_tree(self) -> RemotePrefixTree:
        return RemotePrefixTree(self)

    def get_cache_load(self, reqs: Sequence[Sequence[int]], hardware: HardwareProfile,
                       latency: LatencyModel) -> float:
        request = CpCacheLoad(tuple(tuple(r) for r in reqs), hardware, latency)
        return self._call(request, CpLoad).load

    def gen_plans(self, batches: Sequence[Batch], dops: Sequence[int],
                  homes: Sequence[int | None] | None = None) -> Plans:
        homes = None if homes is None else tuple(homes)
        self.open_session()
        answer = self._call(CpGenPlans(tuple(batches), tuple(dops), homes), CpPlans)
        plans = answer.plans
        self._in_flight.add(plans.iteration)
        self.adopt_grants(plans, answer.grants)
        return plans

    def complete(self, plans: Plans) -> None:
        self._call(CpComplete(plans.iteration), Ack)
        self._done(plans.iteration)

    def abort(self, plans: Plans) -> None:
        self._call(CpAbort(plans.iteration), Ack)
        self._done(plans.iteration)

    def _done(self, iteration: int) -> None:
        self._in_flight.discard(iteration)
        for key in self._granted.pop(iteration, ()):
            self._grants.pop(key, None)

    def plan_grants(self, plans: Plans) -> tuple[tuple[bytes, bytes], ...]:
        """The server's grants of ``plans`` (this object's), per sub-batch: what another
        process of this session needs to register them (:meth:`adopt_grants`)."""
        return tuple((self.grant_for(qp), self.grant_for(tp))
                     for qp, tp in zip(plans.query_plans, plans.transfer_plans))

    def adopt_grants(self, plans: Plans, grants: Sequence[tuple[bytes, bytes]]) -> None:
        """Takes the grants of ``plans`` (this object's, or planned by another process of
        this session: the vLLM connector's scheduler side) for this object's data-plane
        clients."""
        ids = self._granted.setdefault(plans.iteration, [])
        for qp, tp, (qg, tg) in zip(plans.query_plans, plans.transfer_plans, grants):
            for plan, grant in ((qp, qg), (tp, tg)):
                self._grants[id(plan)] = (plan, grant)
                ids.append(id(plan))

    def grant_for(self, plan) -> bytes:
        """The server's grant of one of this session's plans (a query or transfer plan
        of an iteration in flight): its data-plane clients register the plan with it."""
        known = self._grants.get(id(plan))
        return known[1] if known is not None and known[0] is plan else b""

    def read_grant(self, request_id: str, instance: int) -> bytes:
        """The grant to read this session's leased slots of ``request_id`` on
        ``instance`` (``READ_SEGMENT``), as the server gave it with the lease."""
        return self._read_grants.get((request_id, instance), b"")

    def lease_prefix(self, request_id: str, prefix_token_ids: Sequence[int],
                     cache_salt: str | None = None) -> tuple[SegmentLocation, ...]:
        """:meth:`~tokenlake.core.control.ControlPlane.lease_prefix` on the server."""
        self.open_session()
        request = CpLeasePrefix(request_id, tuple(int(t) for t in prefix_token_ids),
                                cache_salt or None)
        answer = self._call(request, CpLeased)
        for instance, grant in answer.grants:
            self._read_grants[(request_id, instance)] = grant
        return answer.locations

    def lease_grants(self, request_id: str) -> tuple[tuple[int, bytes], ...]:
        """``(instance, read grant)`` of every instance a lease of ``request_id`` reads
        (to hand to another process of this session: the vLLM connector's worker)."""
        return tuple((inst, g) for (rid, inst), g in self._read_grants.items() if rid == request_id)

    def finish_request(self, request_id: str) -> None:
        self._call(CpFinishRequest(request_id), Ack)
        for key in [k for k in self._read_grants if k[0] == request_id]:
            del self._read_grants[key]

    def stats(self) -> ControlStats:
        return self._call(CpStats(), CpStatsResult).stats

    def stats_and_sessions(self) -> tuple[ControlStats, tuple[SessionInfo, ...]]:
        """The statistics and the client sessions open on the pool (one round trip;
        reading them opens no session)."""
        answer = self.status()
        return answer.stats, answer.sessions

    def status(self) -> CpStatsResult:
        """Everything ``tokenlake status`` shows, as the server's answer (one round
        trip; opens no session): statistics, sessions, and the segments each instance
        brought back if the pool was adopted after its control process died."""
        return self._call(CpStats(), CpStatsResult)

    @property
    def instances(self) -> tuple[int, ...]:
        """The ids of the pool's instances now (one round trip)."""
        return self._call(CpStats(), CpStatsResult).instances

    def buffer_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes of a client's ``q``, ``out_o``, ``out_lse`` and ``kv`` buffers on
        every instance (one round trip; opens nothing)."""
        return dict(self._call(CpStats(), CpStatsResult).buffers)

    def layout(self) -> tuple[str, int]:
        """``(namespace, segment_tokens)`` of the pool (one round trip): a client that
        stores or reads KV checks the namespace names its model and KV layout."""
        answer = self._call(CpStats(), CpStatsResult)
        return answer.namespace, answer.segment_tokens

    # ------------------------------------------------------------ the data plane
    def client(self, instance: int) -> InstanceClient:
        """The data-plane client of ``instance`` (opened on first use): its buffers are
        mapped from shared memory, so this process must run on the instance's machine.
        A dead engine shows as ``EngineUnavailable`` after the client's timeout."""
        if instance not in self._clients:
            info = self.client_info(instance)
            buffers = {}
            for name, spec in info.buffers.items():
                shared = SharedTensor.attach(spec)
                self._attached.append(shared)
                buffers[name] = shared.tensor
            keys = None if info.keys is None else ClusterKeys.from_dict(dict(info.keys))
            client = InstanceClient(instance, dict(info.endpoints), buffers, lambda: None,
                                    info.timeout_s, keys=keys, routing_id=self.routing_id,
                                    grant_for=self.grant_for)
            client.start(self._ctx)
            self._clients[instance] = client
        return self._clients[instance]

    def reader(self, instance: int, connection: int) -> SegmentReader:
        """A new reader of ``instance``'s slots by message (``READ_SEGMENT``), on this
        session's ``connection`` (1 to 250; not this object's own: one connection per
        routing id and engine). It maps none of the session's buffers, so it also works
        where :meth:`client` cannot (another machine). The caller closes it (at the
        latest :meth:`close` does)."""
        if not 1 <= connection <= 250 or connection == self.connection:
            raise ConfigError(f"a reader needs a connection in [1, 250] other than this "
                              f"object's ({self.connection}), got {connection}")
        info = self.client_info(instance)
        keys = None if info.keys is None else ClusterKeys.from_dict(dict(info.keys))
        reader = SegmentReader(instance, info.endpoints["transfer"], keys, alias(self.token, connection))
        self._readers = [r for r in self._readers if not r.closed]
        self._readers.append(reader.start(self._ctx))
        return reader

    def client_info(self, instance: int) -> CpClientInfoResult:
        """What opening ``instance``'s data-plane client needs: its engines' endpoints,
        this session's buffers there (made on first use) and the cluster's wait limit
        (seconds)."""
        self.open_session()
        return self._call(CpClientInfo(instance), CpClientInfoResult)

    # ------------------------------------------------------------ the session
    def open_session(self) -> CpSession:
        """Opens this object's session with the server, once (every call that plans,
        stores or reads does it first), and starts heartbeating. Raises
        ``CapacityError`` when the server serves as many sessions as it may."""
        if self.session is None:
            self.session = self._call(CpOpenSession(os.getpid(), self.label), CpSession)
            self._beat_stop.clear()
            self._beat = threading.Thread(target=self._heartbeat, name="tokenlake-heartbeat",
                                          daemon=True)
            self._beat.start()
        return self.session

    def _heartbeat(self) -> None:
        """Tells the server every ``heartbeat_s`` that this session is alive, until
        :meth:`close` or the server says it ended the session."""
        every = self.session.heartbeat_s
        while not self._beat_stop.wait(every):
            try:
                self._call(CpHeartbeat(), Ack)
            except SessionEnded:
                return  # the next call that needs the session raises it
            except TokenLakeError:  # a server that does not answer now: keep trying
                continue

    def _stop_heartbeat(self) -> None:
        self._beat_stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None

    # ------------------------------------------------------------ internals
    def _call(self, request: WireMessage, reply: type[M]) -> M:
        """Sends ``request`` and returns the answer to it as a ``reply`` (answers to
        earlier calls that timed out are skipped)."""
        if self._sock is None:
            raise EngineUnavailable(f"not connected to {self.address} (closed, or never started)")
        with self._lock:
            msg_id = next(self._ids)
            deadline = time.monotonic() + self.timeout_s
            try:
                send(self._sock, request.encode(msg_id), timeout_s=self.timeout_s)
                while True:
                    answer = wire.recv(self._sock, max(deadline - time.monotonic(), 0.0))
                    if answer.msg_id == msg_id:
                        return expect(answer, reply)
            except EngineUnavailable:
                hint = ("" if self.keys is not None else " (a pool served with CURVE answers only "
                        "clients with its credentials: pass credentials= the file tokenlake "
                        "serve wrote)")
                raise EngineUnavailable(
                    f"the control-plane server at {self.address} did not answer "
                    f"{request.KIND.name} within {self.timeout_s:g} s{hint}") from None

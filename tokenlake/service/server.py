"""``ControlServer``: one cluster's control plane, served on a ZeroMQ control port.

    with LocalCluster(2, model, pool_bytes) as cluster, ControlServer(cluster, port=7400) as server:
        ...   # other processes: tokenlake.connect(server.address)

The control plane stays the single writer of cache metadata (docs/design.md §9 "One
writer, many clients"): one server thread owns it and answers the requests of every
client one after the other, so concurrent clients are serialised, never interleaved
inside a call. While it serves, the owning process calls the control plane only through
:meth:`ControlServer.shared_control` (the HTTP front end's serving loop does), whose
calls take the same lock as the remote clients' requests.

Requests and answers are the typed ``CP_*`` messages
(:mod:`tokenlake.dataplane.messages.service`). A request that cannot be read, or whose
call fails, is answered with ``ERROR`` (the client raises the typed exception); a
request that cannot be read never reaches the control plane, and a failed call leaves it
as :class:`~tokenlake.core.control.ControlPlane` promises (a failed ``gen_plans``
changes nothing).

Every client that plans, stores or reads is a **session** (docs/design.md §10,
:mod:`tokenlake.service.sessions`): it opens one (``CP_OPEN_SESSION``) on a connection
whose routing id is its token, and from then on the server knows every request on that
connection as the session's. A session's request ids are its own (two clients may both
say ``"r1"``), its iterations can be completed or aborted by it alone, its data-plane
buffers on each instance are its own (``CP_CLIENT_INFO`` creates them), and when it
stops heartbeating the server ends it within ``timeout_s``: its engines' state first
(so no write of it lands later), then its iterations are aborted (the segments it had
not finished storing leave the pool) and its requests finished (their leases and tails
go back). Reading statistics and matching prefixes need no session.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import zmq

from tokenlake.core.control import ControlPlane
from tokenlake.core.errors import ConfigError, PlanError, SegmentInFlight, TokenLakeError
from tokenlake.core.plans import (
    Plans,
)
from tokenlake.dataplane import grants, messages, wire
from tokenlake.dataplane.auth import ClusterKeys, guard, serve_secure
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
    WireMessage,
)
from tokenlake.dataplane.shm_files import BufferSpec
from tokenlake.dataplane.sockets import bind_address, send_routed
from tokenlake.deploy.base import CLIENT_BUFFERS
from tokenlake.service.serialised import Serialised
from tokenlake.service.session_plans import lease_grants, plan_grants, renamed_batch, renamed_plans
from tokenlake.service.sessions import (
    HEARTBEAT_S,
    ITERATION_TIMEOUT_S,
    MAX_SESSIONS,
    SESSION_TIMEOUT_S,
    Session,
    SessionTable,
)

log = logging.getLogger(__name__)

DEFAULT_CONTROL_PORT = 7400
#: the largest control request accepted (a batch of long prompts' token ids fits many
#: times over); ZeroMQ drops a client that sends more before buffering it
MAX_CONTROL_MESSAGE_BYTES = 64 << 20


class ServedCluster(Protocol):
    """What the server needs of a launcher (``LocalCluster``, ``RayCluster``)."""

    control: ControlPlane
    keys: ClusterKeys | None  # the cluster's CURVE keys (None: started insecure)

    def open_session(self, token: bytes, session: int, instance: int) -> Mapping[str, Any]:
        """A client session's own buffers on ``instance``, registered with its engines:
        ``{"endpoints": {role: endpoint}, "buffers": {name: BufferSpec dict},
        "timeout_s": float, "keys": member keys or None, "slab": spec dict or None}``
        (:meth:`~tokenlake.deploy.base.ClusterBase.open_session`)."""

    def close_session(self, token: bytes) -> None:
        """Ends a client session on its engines and unlinks its buffers."""

    grant_key: bytes  # signs client sessions' plans and leases (tokenlake.dataplane.grants)
    layout: Any  # the instances' BufferLayout (its shapes() tell a client its buffers)

    def retire(self, token: bytes, instances, grant_ids: tuple[int, ...]) -> None:
        """Spends grants of a client session on the engines of ``instances``."""


class ControlServer:
    """Serves ``cluster.control`` (and its instances' client info) on a ROUTER socket.

    Args:
        cluster: the launcher whose control plane is served (started by the caller).
        host: the interface to bind (loopback by default). The port speaks CURVE with
            the cluster's keys (``cluster.keys``) and admits only the cluster's owner and
            members (:meth:`credentials` is what a member needs); a cluster started
            ``insecure`` is served without CURVE, and another host than loopback is then
            logged as a warning.
        port: the TCP port; 0 binds any free one (read :attr:`address`).
        poll_s: how often the serving thread checks for :meth:`close` and for silent
            sessions (seconds).
        session_timeout_s: silence after which a client session is ended (its clients
            heartbeat every ``heartbeat_s``); iteration_timeout_s: the longest one of its
            iterations may stay in flight; max_sessions: client sessions at once
            (:mod:`tokenlake.service.sessions`).
        clock: the sessions' clock (monotonic seconds).

    The constructor only stores; :meth:`start` binds and starts the thread,
    :meth:`close` stops it (both idempotent; also a context manager).
    """

    def __init__(self, cluster: ServedCluster, host: str = "127.0.0.1", port: int = 0,
                 poll_s: float = 0.05, session_timeout_s: float = SESSION_TIMEOUT_S,
                 heartbeat_s: float = HEARTBEAT_S, iteration_timeout_s: float = ITERATION_TIMEOUT_S,
                 max_sessions: int = MAX_SESSIONS, clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster, self.host, self.port, self.poll_s = cluster, host, port, poll_s
        if not 0 < heartbeat_s < session_timeout_s:
            raise ConfigError(f"heartbeat_s must be in (0, session_timeout_s={session_timeout_s:g}), "
                              f"got {heartbeat_s:g}")
        self.heartbeat_s = heartbeat_s
        self.sessions = SessionTable(clock, session_timeout_s, iteration_timeout_s, max_sessions)
        self.keys: ClusterKeys | None = getattr(cluster, "keys", None)
        self._gate = None
        self.address = ""  # tcp://host:port once started
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._issued: dict[int, Plans] = {}  # plans in flight, by iteration
        self._lease_numbers = itertools.count()  # the grant ids of leases
        self.lock = threading.RLock()  # held for every call of the control plane
        # requests anyone admitted may send, and those of a session (with it)
        self._handlers: dict[type, Callable[[Any], WireMessage]] = {
            CpMatch: self._match, CpCacheLoad: self._cache_load, CpStats: self._stats,
        }
        self._session_handlers: dict[type, Callable[[Session, Any], WireMessage]] = {
            CpGenPlans: self._gen_plans, CpComplete: self._complete, CpAbort: self._abort,
            CpFinishRequest: self._finish, CpClientInfo: self._client_info,
            CpLeasePrefix: self._lease_prefix, CpHeartbeat: self._heartbeat,
        }

    # ------------------------------------------------------------ lifecycle
    def start(self) -> ControlServer:
        """Binds the control port and starts serving; returns ``self``."""
        if self._thread is not None:
            return self
        self._ctx = zmq.Context()
        self._gate = guard(self._ctx, self.keys)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
        serve_secure(self._sock, self.keys)
        try:
            self._sock.bind(bind_address(self.host, self.port or None, secure=self.keys is not None))
        except zmq.ZMQError as e:
            self._release()
            raise ConfigError(f"cannot bind the control port {self.host}:{self.port}: {e}") from e
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, name="tokenlake-control", daemon=True)
        self._thread.start()
        log.info("control plane served on %s", self.address)
        return self

    def credentials(self) -> dict[str, Any]:
        """What a client needs to call this server: ``{"address", "keys"}`` with the
        member's CURVE keys (``None`` when insecure). ``tokenlake serve`` writes it to a
        file of mode 0600 (:func:`tokenlake.dataplane.credentials.write`)."""
        return {"address": self.address,
                "keys": None if self.keys is None else self.keys.member_view().to_dict()}

    def close(self) -> None:
        """Stops serving, ends every client session (what they left in flight is
        aborted) and closes the port (the cluster stays up: its owner closes it)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            for session in self.sessions:
                self.end_session(session, "the server stops")
        self._release()

    def __enter__(self) -> ControlServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._gate is not None:
            self._gate.stop()
            self._gate = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------ serving
    def _serve(self) -> None:
        """The thread that owns the control plane: one request at a time, and between
        them the sessions that went silent are ended."""
        sock = self._sock
        while not self._stop.is_set():
            if sock.poll(int(self.poll_s * 1000) + 1, zmq.POLLIN):
                frames = sock.recv_multipart(copy=False)
                cut = 2 if len(frames) > 2 and len(frames[1]) == 0 else 1  # a REQ peer's delimiter
                envelope, reply = frames[:cut], self._answer(frames[0].bytes, frames[cut:])
                try:
                    send_routed(sock, envelope, reply, timeout_s=self.poll_s)
                except Exception as e:  # the client went away: nothing to tell it
                    log.warning("control reply dropped: %s", e)
            for session, why in self.sessions.expired():
                self.end_session(session, why)

    def _answer(self, identity: bytes, frames: list) -> list:
        """The reply frames to one request's frames from client ``identity`` (``ERROR`` on any failure)."""
        msg_id = 0
        try:
            msg_id, request = messages.decode(frames)
            with self.lock:
                if isinstance(request, CpOpenSession):
                    answer = self._open_session(identity, request)
                elif isinstance(request, CpCloseSession):
                    answer = self._close_session(self.sessions.get(identity), identity)
                elif type(request) in self._session_handlers:
                    session = self.sessions.get(identity)  # SessionEnded if there is none
                    answer = self._session_handlers[type(request)](session, request)
                elif type(request) in self._handlers:
                    self.sessions.touch(identity)  # a session's request is a heartbeat too
                    answer = self._handlers[type(request)](request)
                else:
                    raise wire.WireError(f"{request.KIND.name} is not a control-plane request")
            return answer.encode(msg_id)
        except Exception as e:  # every failure becomes the client's typed exception
            msg_id = getattr(e, "msg_id", None) or msg_id
            log.info("control request %d refused: %s: %s", msg_id, type(e).__name__, e)
            return wire.error_message(msg_id, e)

    # ------------------------------------------------------------ sessions
    def _open_session(self, identity: bytes, req: CpOpenSession) -> CpSession:
        try:
            session = self.sessions.open(identity, req.pid, req.label)
        except ValueError as e:
            raise PlanError(str(e)) from None
        if len(session.connections) == 1:
            log.info("session %d opened (pid %d, %s)", session.number, session.pid, session.label or "-")
        return CpSession(session.number, self.heartbeat_s, self.sessions.timeout_s)

    def _heartbeat(self, session: Session, req: CpHeartbeat) -> Ack:
        return Ack()

    def _close_session(self, session: Session, identity: bytes) -> Ack:
        if self.sessions.leave(session, identity):  # the last of its connections left
            self.end_session(session, "closed by the client")
        return Ack()

    def end_session(self, session: Session, why: str) -> None:
        """Ends ``session``: its engines forget it and answer once nothing it started is
        running (no write of it lands after this), then its iterations in flight are
        aborted (the segments it had not finished storing leave the pool) and its
        requests finished (their leases and open tails go back), its buffers unlinked."""
        with self.lock:  # the table drops it last: once it is gone, all of this is done
            try:
                self.cluster.close_session(session.token)
            except Exception:  # noqa: BLE001 - the control plane must be freed regardless
                log.exception("could not close session %d on its engines", session.number)
            control = self.cluster.control
            aborted = finished = 0
            for iteration in sorted(session.iterations):
                plans = self._issued.pop(iteration, None)
                if plans is not None:
                    try:
                        control.abort(plans)
                        aborted += 1
                    except TokenLakeError as e:
                        log.warning("session %d: aborting iteration %d failed: %s", session.number, iteration, e)
            session.iterations.clear()
            live = set(control.live_requests)
            for rid in sorted(session.requests & live):
                try:
                    control.finish_request(rid)
                    finished += 1
                except TokenLakeError as e:
                    log.warning("session %d: finishing request %s failed: %s", session.number, rid, e)
            session.requests.clear()
            session.leases.clear()
            if why != "closed by the client":
                self.sessions.ended += 1
            self.sessions.remove(session)
            log.log(logging.INFO if why == "closed by the client" else logging.WARNING,
                    "session %d (pid %d, %s) ended: %s; %d iterations aborted, %d requests finished",
                    session.number, session.pid, session.label or "-", why, aborted, finished)

    def shared_control(self) -> Serialised:
        """The served control plane for this process: every call (and every call on
        the prefix tree it returns) holds :attr:`lock`, so it never interleaves with a
        remote client's request."""
        return Serialised(self.cluster.control, self.lock)

    # ------------------------------------------------------------ the calls
    def _match(self, req: CpMatch) -> CpMatched:
        tree = self.cluster.control.get_prefix_tree()
        return CpMatched(tree.match(req.tokens, req.max_tokens, req.salt))

    def _cache_load(self, req: CpCacheLoad) -> CpLoad:
        return CpLoad(self.cluster.control.get_cache_load(req.reqs, req.hardware, req.latency))

    def _gen_plans(self, session: Session, req: CpGenPlans) -> CpPlans:
        batches = tuple(renamed_batch(b, session.prefix) for b in req.batches)
        try:
            plans = self.cluster.control.gen_plans(batches, req.dops, req.homes)
        except SegmentInFlight as e:  # the client's own names for the requests that wait
            raise SegmentInFlight(str(e).replace(f"'{session.prefix}", "'"), tuple(
                self.sessions.external(session, r) for r in e.request_ids)) from None
        self._issued[plans.iteration] = plans
        session.iterations[plans.iteration] = self.sessions.clock()
        session.requests.update(r.request_id for b in batches for r in b.requests)
        theirs = renamed_plans(plans, session.prefix)
        return CpPlans(theirs, plan_grants(self.cluster.grant_key, session.token, theirs))

    def _complete(self, session: Session, req: CpComplete) -> Ack:
        plans = self._take(session, req.iteration)
        self._retire_plans(session, plans)  # before the new segments become visible
        self.cluster.control.complete(plans)
        self._forget_finished(session)
        return Ack()

    def _abort(self, session: Session, req: CpAbort) -> Ack:
        plans = self._take(session, req.iteration)
        self._retire_plans(session, plans)  # before the slots can go to anyone else
        self.cluster.control.abort(plans)
        self._forget_finished(session)
        return Ack()

    def _retire_plans(self, session: Session, plans: Plans) -> None:
        """The iteration's grants are spent on its homes' engines: nothing the session
        registered under them can touch the pool again."""
        homes = sorted({qp.home for qp in plans.query_plans})
        self.cluster.retire(session.token, homes, (grants.plan_grant_id(plans.iteration),))

    def _take(self, session: Session, iteration: int) -> Plans:
        if iteration not in session.iterations:
            raise PlanError(f"iteration {iteration} has no plans in flight for this session")
        del session.iterations[iteration]
        return self._issued.pop(iteration)

    def _forget_finished(self, session: Session) -> None:
        """Drops the session's requests the control plane no longer knows (admitted in
        an iteration that was aborted)."""
        if session.requests:
            session.requests &= set(self.cluster.control.live_requests)

    def _lease_prefix(self, session: Session, req: CpLeasePrefix) -> CpLeased:
        rid = self.sessions.internal(session, req.request_id)
        locations = self.cluster.control.lease_prefix(rid, req.tokens, req.cache_salt)
        session.requests.add(rid)
        gid = grants.lease_grant_id(next(self._lease_numbers))
        read = lease_grants(self.cluster.grant_key, session.token, gid, locations)
        session.leases[rid] = (gid, tuple(inst for inst, _ in read))
        return CpLeased(locations, read)

    def _finish(self, session: Session, req: CpFinishRequest) -> Ack:
        rid = self.sessions.internal(session, req.request_id)
        lease = session.leases.pop(rid, None)
        if lease is not None:  # its reads are spent before its slots may go elsewhere
            self.cluster.retire(session.token, lease[1], (lease[0],))
        self.cluster.control.finish_request(rid)
        session.requests.discard(rid)
        return Ack()

    def _stats(self, req: CpStats) -> CpStatsResult:
        control = self.cluster.control
        shapes = self.cluster.layout.shapes()
        adopted = getattr(self.cluster, "adopted", None)
        restored = () if adopted is None else tuple(
            (i, adopted.restored.get(i, 0)) for i in control.instances)
        return CpStatsResult(control.stats(), tuple(control.instances), control.config.namespace,
                             control.config.segment_tokens, self.sessions.infos(),
                             tuple((name, shapes[name]) for name in CLIENT_BUFFERS), restored)

    def _client_info(self, session: Session, req: CpClientInfo) -> CpClientInfoResult:
        if req.instance not in self.cluster.control.instances:
            raise ConfigError(f"no instance {req.instance} in the pool")
        info = self.cluster.open_session(session.token, session.number, req.instance)
        session.instances.add(req.instance)
        buffers = {name: BufferSpec.from_dict(spec) for name, spec in info["buffers"].items()}
        slabs = {i: BufferSpec.from_dict(d) for i in self.cluster.control.instances  # mappable on the
                 if (d := self.cluster.mappable_slab(i)) is not None}  # pool's machine (docs/security.md)
        return CpClientInfoResult(req.instance, dict(info["endpoints"]), buffers, float(info["timeout_s"]),
                                  info.get("keys"), slabs.pop(req.instance, None), tuple(slabs.items()))

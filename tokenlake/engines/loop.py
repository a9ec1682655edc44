"""What the query and transfer engines share: the start-up handshake, the event loop
with its peers, and the body of their process entry points (their spec:
:mod:`tokenlake.engines.spec`).

An engine is one process per instance and role. It binds one ROUTER socket (clients
and peer engines connect to it with DEALER sockets), maps its instance's slab from
shared memory, and serves messages until told to stop or until its parent dies. The
loop never blocks on one peer: requests it sends to peers are answered on their DEALER
sockets and matched by message id, with a deadline each (docs/design.md §4 "Failure").

Every request is checked against who sent it (:class:`Caller`) before it is served:
the lifecycle kinds (``SHUTDOWN``, ``PEERS``, ``OPEN_SESSION``, ``CLOSE_SESSION``,
``COPY_SEGMENT``) come from the cluster's owner only, the peer kinds (``PEER_*``) from
another engine only, and a plan operation (register, query, put, release) acts in the
caller's session: the buffers and plan ids of a client session
(:mod:`tokenlake.dataplane.messages.session`) are its own, and the owner's in-process
clients use the instance's own buffers (session ``b""``). Without CURVE nothing is
authenticated: a request on a session's routing id is that session's, any other is the
owner's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import zmq

from tokenlake.core.errors import (
    ConfigError,
    EngineUnavailable,
    TokenLakeError,
)
from tokenlake.dataplane import messages, pool_state, wire
from tokenlake.dataplane.auth import (
    ClusterKeys,
    connect_secure,
    guard,
    serve_secure,
)
from tokenlake.dataplane.messages import (
    Ack,
    Adopt,
    CloseSession,
    ErrorReply,
    OpenSession,
    Peers,
    Ping,
    Pong,
    Retire,
    Shutdown,
    WireMessage,
)
from tokenlake.dataplane.ratelog import RateLimitedLog
from tokenlake.dataplane.shm import SharedTensor
from tokenlake.dataplane.shm_files import BufferSpec, cluster_prefix, unlink_prefix
from tokenlake.dataplane.sockets import is_loopback, send_frames
from tokenlake.dataplane.tensor_frames import CopyStats, WireError
from tokenlake.engines.bells import EngineBells
from tokenlake.engines.owner import OwnerWatch
from tokenlake.engines.sessions import OWNER_SESSION, Caller, EngineSessions
from tokenlake.engines.spec import ROLES, EngineSpec

log = logging.getLogger(__name__)

__all__ = ["OWNER_SESSION", "ROLES", "Caller", "EngineLoop", "EngineSpec", "Pending", "run_engine"]

@dataclass
class Pending:
    """A request this engine sent to peers and is still waiting for: it completes
    (``on_done``) when every peer answered with an ``expect`` message, and fails
    (``on_fail``, once) on the first ``ERROR``, on another reply kind, or at ``deadline``
    (``time.monotonic()`` seconds)."""

    deadline: float
    expect: type[WireMessage]
    waiting: set[int] = field(default_factory=set)  # message ids not answered yet
    results: list[tuple[int, WireMessage]] = field(default_factory=list)  # (instance, reply)
    on_done: Callable[[Pending], None] | None = None
    on_fail: Callable[[Pending, BaseException], None] | None = None
    asked: dict[int, int] = field(default_factory=dict)  # message id -> the peer instance
    session: bytes = OWNER_SESSION  # on whose behalf (a closing session waits for it)


class EngineLoop(OwnerWatch, EngineSessions, EngineBells):
    """Single-threaded event loop: one ROUTER for incoming work, one DEALER per peer, the
    sessions' doorbells (engine_bells.py). Every message is read once into its typed
    message (:mod:`tokenlake.dataplane.messages`). The loop answers ``PING``, ``PEERS``
    and ``SHUTDOWN`` itself; subclasses implement :meth:`handle` (any other request, on
    the ROUTER) and use :meth:`ask` to send requests to peers whose replies complete a
    :class:`Pending`."""

    tick_s = 0.1

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.ctx: zmq.Context | None = None
        self.router: zmq.Socket | None = None
        self.endpoint = ""
        self.peers: dict[int, zmq.Socket] = {}
        self._pending: dict[int, Pending] = {}  # msg id -> pending op
        self._next_id = 1
        self._stop = False
        self._handled = 0  # requests served (ROUTER messages)
        self.peer_replies = 0  # answers received from peers (late ones included)
        self._busy_s = 0.0  # seconds spent handling messages (not waiting)
        self._rejected = RateLimitedLog(log)
        self._peers_changed = True  # serve() rebuilds its poller when set
        self.keys = ClusterKeys.from_dict(spec.keys) if spec.keys is not None else None
        self._gate = None
        self._init_sessions()
        self._init_bells()  # per-layer hand-offs in shared memory (engine_bells.py)
        self._init_owner()  # the launcher's death, the grace, adoption (engine_owner.py)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Binds the ROUTER on a free port of ``spec.host`` (the first free one of
        ``spec.port_range`` when set); returns its endpoint. With keys, the ROUTER is a
        CURVE server that admits only the cluster's owner and members."""
        self.ctx = zmq.Context()
        self._gate = guard(self.ctx, self.keys)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes())
        serve_secure(self.router, self.keys)
        if self.keys is None and not is_loopback(self.spec.host):
            log.warning("%s engine %d binds %s without CURVE (insecure): trusted networks only",
                        self.spec.role, self.spec.instance, self.spec.host)
        if self.spec.port_range is None:
            self.router.bind(f"tcp://{self.spec.host}:*")
        else:
            first, last = self.spec.port_range
            for port in range(first, last + 1):
                try:
                    self.router.bind(f"tcp://{self.spec.host}:{port}")
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE:
                        raise
            else:
                raise ConfigError(f"no free port in {first}-{last} on {self.spec.host}")
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    def connect_peers(self, endpoints: dict[int, str | None]) -> None:
        """Opens a DEALER to every other engine of the same role.

        Called again (``PEERS`` message, after an instance was restarted elsewhere), it
        replaces the socket of every instance named: the old one is closed, dropping
        what was still queued for the old address, and an endpoint of ``None`` just
        forgets that peer. Requests pending on a dropped socket fail at their deadline.
        """
        assert self.ctx is not None
        fresh: dict[int, zmq.Socket] = {}
        try:  # every new socket first: one endpoint that cannot be used changes nothing
            for inst, ep in endpoints.items():
                if inst == self.spec.instance or ep is None:
                    continue
                sock = fresh[inst] = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                connect_secure(sock, self.keys, as_engine=True)
                sock.connect(ep)
        except zmq.ZMQError as e:
            for sock in fresh.values():
                sock.close(0)
            raise ConfigError(f"instance {self.spec.instance}: bad peer endpoint: {e}") from None
        for inst in endpoints:
            if inst == self.spec.instance:
                continue
            old = self.peers.pop(inst, None)
            if old is not None:
                old.close(0)
            if inst in fresh:
                self.peers[inst] = fresh[inst]
        self._peers_changed = True

    def map_buffers(self) -> dict[str, torch.Tensor]:
        """Maps the shared buffers named in the spec (closed again by :meth:`close`); the
        home buffers among them (all but the slab) are the owner's session's."""
        self._maps = {n: SharedTensor.attach(BufferSpec.from_dict(d)) for n, d in self.spec.buffers.items()}
        bufs = {n: m.tensor for n, m in self._maps.items()}
        self.sessions[OWNER_SESSION] = {n: t for n, t in bufs.items() if n != "slab"}
        self.open_bell(OWNER_SESSION, bufs.get("bell"), self._maps["bell"].spec if "bell" in bufs else None)
        return bufs

    def map_shared_slabs(self, slab: torch.Tensor) -> dict[int, torch.Tensor]:
        """Maps the other instances' slabs named in ``spec.shared_slabs`` (closed by
        :meth:`close`); each must have the shape and dtype of this instance's ``slab``."""
        out = {}
        for inst, raw in self.spec.shared_slabs.items():
            shared = self._maps[f"slab@{inst}"] = SharedTensor.attach(BufferSpec.from_dict(raw))
            if shared.tensor.shape != slab.shape or shared.tensor.dtype != slab.dtype:
                raise ConfigError(f"instance {inst}'s slab {tuple(shared.tensor.shape)} {shared.tensor.dtype} "
                                  f"differs from this one's {tuple(slab.shape)} {slab.dtype}")
            out[int(inst)] = shared.tensor
        return out

    def close(self) -> None:
        self.close_bells()
        for m in getattr(self, "_maps", {}).values():
            m.close()
        self._close_session_maps()
        for sock in self.peers.values():
            sock.close(0)
        if self.router is not None:
            self.router.close(0)
        if self._gate is not None:
            self._gate.stop()
        if self.ctx is not None:
            self.ctx.term()

    def _poller(self) -> tuple[zmq.Poller, dict]:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        by_socket: dict = {}
        for inst, sock in self.peers.items():
            poller.register(sock, zmq.POLLIN)
            by_socket[sock] = inst
        for fd in self.polled_fds():  # the sessions' doorbells (raw FIFO fds), the wakers
            poller.register(fd, zmq.POLLIN)
        self._peers_changed = False
        return poller, by_socket

    def serve(self) -> None:
        """Runs until a SHUTDOWN message arrives or the parent process is gone."""
        poller, by_socket = self._poller()
        while not self._stop:
            if self._peers_changed:
                poller, by_socket = self._poller()
            for sock, _ in poller.poll(int(self.tick_s * 1000)):
                if self._peers_changed:
                    break  # a peer socket of this poll may be closed: poll again
                t0 = time.perf_counter()
                if sock is self.router:
                    self._on_request(sock.recv_multipart(copy=False))
                    self._handled += 1
                elif isinstance(sock, int):
                    self.serve_fd(sock)
                else:
                    self._on_reply(by_socket[sock], sock.recv_multipart(copy=False))
                self._busy_s += time.perf_counter() - t0
            self._expire()
            if self.owner_gone():
                break

    def max_message_bytes(self) -> int:
        """The largest frame this engine accepts: twice the largest legitimate one (a
        slab slot, or a whole q/kv buffer), at least 16 MiB. ZeroMQ drops a peer that
        sends more, before any of it is buffered here."""
        specs = [BufferSpec.from_dict(d) for d in self.spec.buffers.values()]
        largest = max(spec.nbytes // (spec.shape[0] if name == "slab" else 1)
                      for name, spec in zip(self.spec.buffers, specs))
        return max(16 << 20, 2 * largest)

    def stats(self) -> Pong:
        """What a PING is answered with: identity and the bytes this process copied on
        the wire path (``CopyStats``)."""
        return Pong(self.spec.role, self.spec.instance, CopyStats.bytes_copied,
                    CopyStats.messages, self._handled, self._busy_s, self.bell_handoffs)

    # ------------------------------------------------------------- messages
    def _on_request(self, frames: list) -> None:
        identity, payload = frames[0], frames[1:]
        msg_id = 0
        try:
            msg = wire.decode(payload)
            msg_id = msg.msg_id
            message = messages.parse(msg)
            caller = self._caller(identity, payload[0])
            self._authorize(caller, message)
            if isinstance(message, Shutdown):
                self._stop = True
                self.reply(identity, Ack().encode(msg_id))
            elif isinstance(message, Ping):
                self.reply(identity, self.stats().encode(msg_id))
            elif isinstance(message, Peers):
                self.connect_peers(dict(message.peers))
                self.reply(identity, Ack().encode(msg_id))
            elif isinstance(message, OpenSession):
                self._open_session(message)
                self.reply(identity, Ack().encode(msg_id))
            elif isinstance(message, CloseSession):
                self._close_session(identity, msg_id, message.token)
            elif isinstance(message, Retire):
                self._retire(identity, msg_id, message)
            elif isinstance(message, Adopt):
                self._adopt(message)
                self.reply(identity, Ack().encode(msg_id))
            else:
                self.serve_bell_first(caller.session)  # a session's hand-offs in its order
                self.handle(identity, msg_id, message, caller)
        except Exception as exc:  # a bad request must not stop the engine
            self.refuse(identity, getattr(exc, "msg_id", None) or msg_id, exc)  # (WireError knows its id)

    def refuse(self, identity, msg_id: int, exc: BaseException) -> None:
        """Answers request ``msg_id`` with ``ERROR`` for ``exc`` and notes it (rate-limited)."""
        if not isinstance(exc, TokenLakeError):  # a case no check caught: still typed
            exc = WireError(f"request refused: {type(exc).__name__}: {exc}")
        self._rejected.note(f"{self.spec.role} engine {self.spec.instance}: refused a "
                            f"request: {type(exc).__name__}: {exc}")
        self.reply(identity, wire.error_message(msg_id, exc))

    def _on_reply(self, instance: int, frames: list) -> None:
        self.peer_replies += 1  # read by tests: a peer's answer was taken in
        try:
            msg_id, reply = messages.decode(frames)
        except WireError as exc:
            self._rejected.note(f"{self.spec.role} engine {self.spec.instance}: malformed "
                                f"reply from instance {instance}: {exc}")
            return
        pending = self._pending.pop(msg_id, None)
        if pending is None:
            return  # late reply of an op that already failed, or of a message sent without waiting
        pending.waiting.discard(msg_id)
        if isinstance(reply, ErrorReply):
            self._fail(pending, reply.exception())
            return
        if not isinstance(reply, pending.expect):
            self._fail(pending, WireError(f"instance {instance} answered {reply.KIND.name}, "
                                          f"not {pending.expect.KIND.name}"))
            return
        pending.results.append((instance, reply))
        if not pending.waiting and pending.on_done is not None:
            try:
                pending.on_done(pending)
            except Exception as exc:  # a peer's answer that cannot be used fails this op only
                log.warning("instance %d: peer results unusable: %s", self.spec.instance, exc)
                self._fail(pending, exc if isinstance(exc, TokenLakeError)
                           else WireError(f"a peer's result could not be used: {exc}"))
        self._settle_closing()

    def reply(self, identity, frames: list) -> None:
        assert self.router is not None
        slab = getattr(self, "slab", None)
        if slab is not None and slab.is_cuda:  # a reply says the work is done: the GPU's too
            torch.cuda.current_stream(slab.device).synchronize()
        send_frames(self.router, [identity, *frames])

    def tell(self, instance: int, message: WireMessage) -> None:
        send_frames(self._peer(instance), message.encode(0))  # no wait: its reply (id 0) is dropped

    def ask(self, instance: int, message: WireMessage, pending: Pending) -> None:
        """Sends ``message`` to a peer; its reply will complete ``pending``."""
        sock = self._peer(instance)
        msg_id, self._next_id = self._next_id, self._next_id + 1
        pending.waiting.add(msg_id)
        pending.asked[msg_id] = instance
        self._pending[msg_id] = pending
        send_frames(sock, message.encode(msg_id))

    def _peer(self, instance: int) -> zmq.Socket:
        if (sock := self.peers.get(instance)) is None:
            raise ConfigError(f"instance {instance} is not a peer of instance {self.spec.instance}")
        return sock

    def new_pending(self, expect: type[WireMessage], session: bytes = OWNER_SESSION) -> Pending:
        """A :class:`Pending` expecting ``expect`` replies within ``peer_timeout_s``, on
        behalf of ``session``; set its ``on_done`` and ``on_fail`` before asking."""
        return Pending(time.monotonic() + self.spec.peer_timeout_s, expect, session=session)

    def _expire(self) -> None:
        now = time.monotonic()
        for msg_id, pending in list(self._pending.items()):
            if pending.deadline < now and msg_id in self._pending:
                silent = sorted({pending.asked.get(m, -1) for m in pending.waiting})
                self._fail(pending, EngineUnavailable(
                    f"the {self.spec.role} engine of instance {self.spec.instance}: the {self.spec.role} "
                    f"engine of instance {', '.join(map(str, silent))} did not answer within "
                    f"{self.spec.peer_timeout_s:.1f} s"))

    def _fail(self, pending: Pending, exc: BaseException) -> None:
        for msg_id in pending.waiting:
            self._pending.pop(msg_id, None)
        pending.waiting.clear()
        if pending.on_fail is not None:
            cb, pending.on_fail, pending.on_done = pending.on_fail, None, None
            cb(pending, exc)
        self._settle_closing()

    def handle(self, identity, msg_id: int, message: WireMessage, caller: Caller) -> None:  # pragma: no cover
        """Serves one request (already read into its typed message and authorized for
        ``caller``); replies with :meth:`reply`. An exception is answered with ``ERROR``
        by the loop."""
        raise NotImplementedError


def run_engine(engine_cls: Callable[[EngineSpec], Any], spec_bytes: bytes, conn) -> None:
    """Runs one engine process: the body of ``query_engine.main`` and ``transfer_engine.main``.

    ``engine_cls`` builds the engine from its :class:`EngineSpec`. Handshake over ``conn``
    (bytes only, msgpack): send ``{"endpoint"}``, receive ``{"peers": {instance:
    endpoint}}``, send ``{"ready": true}``, then serve until told to stop.
    """
    spec = EngineSpec.from_bytes(spec_bytes)
    spec.apply_to_process()
    logging.basicConfig(level=logging.WARNING, format=f"[{spec.role}-{spec.instance}] %(message)s")
    engine = engine_cls(spec)
    try:
        conn.send_bytes(msgpack.packb({"endpoint": engine.start()}))
        peers = msgpack.unpackb(conn.recv_bytes(), strict_map_key=False)["peers"]
        engine.connect_peers({int(k): v for k, v in peers.items()})
        conn.send_bytes(msgpack.packb({"ready": True}))
        profile_dir = os.environ.get("TOKENLAKE_PROFILE_ENGINES")  # developer aid
        if profile_dir:
            __import__("cProfile").runctx("engine.serve()", globals(), {"engine": engine},
                                          os.path.join(profile_dir, f"{spec.role}-{spec.instance}.prof"))
        else:
            engine.serve()
    finally:
        engine.close()
        conn.close()
        if engine.orphaned:  # nobody else will: the owner died without closing
            unlink_prefix(cluster_prefix(spec.cluster_id))
            pool_state.forget(spec.state_file, spec.cluster_id)

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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import zmq

from tokenlake.core.control import ControlPlane
from tokenlake.core.errors import ConfigError, PlanError
from tokenlake.core.plans import Plans
from tokenlake.dataplane import messages, wire
from tokenlake.dataplane.auth import ClusterKeys, guard, serve_secure
from tokenlake.dataplane.messages import (
    Ack,
    CpAbort,
    CpCacheLoad,
    CpClientInfo,
    CpClientInfoResult,
    CpComplete,
    CpFinishRequest,
    CpGenPlans,
    CpLeased,
    CpLeasePrefix,
    CpLoad,
    CpMatch,
    CpMatched,
    CpPlans,
    CpStats,
    CpStatsResult,
    WireMessage,
)
from tokenlake.dataplane.shm_files import BufferSpec
from tokenlake.dataplane.sockets import bind_address, send_routed

log = logging.getLogger(__name__)

DEFAULT_CONTROL_PORT = 7400
#: the largest control request accepted (a batch of long prompts' token ids fits many
#: times over); ZeroMQ drops a client that sends more before buffering it
MAX_CONTROL_MESSAGE_BYTES = 64 << 20


class ServedCluster(Protocol):
    """What the server needs of a launcher (``LocalCluster``, ``RayCluster``)."""

    control: ControlPlane
    keys: ClusterKeys | None  # the cluster's CURVE keys (None: started insecure)

    def client_info(self, instance: int) -> Mapping[str, Any]:
        """``{"endpoints": {role: endpoint}, "buffers": {name: BufferSpec dict},
        "timeout_s": float, ...}`` of a running instance."""


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
        poll_s: how often the serving thread checks for :meth:`close` (seconds).

    The constructor only stores; :meth:`start` binds and starts the thread,
    :meth:`close` stops it (both idempotent; also a context manager).
    """

    def __init__(self, cluster: ServedCluster, host: str = "127.0.0.1", port: int = 0,
                 poll_s: float = 0.05) -> None:
        self.cluster, self.host, self.port, self.poll_s = cluster, host, port, poll_s
        self.keys: ClusterKeys | None = getattr(cluster, "keys", None)
        self._gate = None
        self.address = ""  # tcp://host:port once started
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._issued: dict[int, Plans] = {}  # plans in flight, by iteration
        self.lock = threading.RLock()  # held for every call of the control plane
        self._handlers: dict[type, Callable[[Any], WireMessage]] = {
            CpMatch: self._match, CpCacheLoad: self._cache_load, CpGenPlans: self._gen_plans,
            CpComplete: self._complete, CpAbort: self._abort, CpFinishRequest: self._finish,
            CpStats: self._stats, CpClientInfo: self._client_info,
            CpLeasePrefix: self._lease_prefix,
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
        """Stops serving and closes the port (the cluster stays up: its owner closes it)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
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
        """The thread that owns the control plane: one request at a time."""
        sock = self._sock
        while not self._stop.is_set():
            if not sock.poll(int(self.poll_s * 1000) + 1, zmq.POLLIN):
                continue
            frames = sock.recv_multipart(copy=False)
            cut = 2 if len(frames) > 2 and len(frames[1]) == 0 else 1  # a REQ peer's delimiter
            envelope, reply = frames[:cut], self._answer(frames[cut:])
            try:
                send_routed(sock, envelope, reply, timeout_s=self.poll_s)
            except Exception as e:  # the client went away: nothing to tell it
                log.warning("control reply dropped: %s", e)

    def _answer(self, frames: list) -> list:
        """The reply frames to one request's frames (``ERROR`` on any failure)."""
        msg_id = 0
        try:
            msg_id, request = messages.decode(frames)
            handler = self._handlers.get(type(request))
            if handler is None:
                raise wire.WireError(f"{request.KIND.name} is not a control-plane request")
            with self.lock:
                answer = handler(request)
            return answer.encode(msg_id)
        except Exception as e:  # every failure becomes the client's typed exception
            msg_id = getattr(e, "msg_id", None) or msg_id
            log.info("control request %d refused: %s: %s", msg_id, type(e).__name__, e)
            return wire.error_message(msg_id, e)

    def shared_control(self) -> Serialised:
        """The served control plane for this process: every call (and every call on
        the prefix tree it returns) holds :attr:`lock`, so it never interleaves with a
        remote client's request."""
        return Serialised(self.cluster.control, self.lock)

    # ------------------------------------------------------------ the calls
    def _match(self, req: CpMatch) -> CpMatched:
        tree = self.cluster.control.get_prefix_tree()
        return CpMatched(tree.match(req.tokens, req.max_tokens))

    def _cache_load(self, req: CpCacheLoad) -> CpLoad:
        return CpLoad(self.cluster.control.get_cache_load(req.reqs, req.hardware, req.latency))

    def _gen_plans(self, req: CpGenPlans) -> CpPlans:
        plans = self.cluster.control.gen_plans(req.batches, req.dops, req.homes)
        self._issued[plans.iteration] = plans
        return CpPlans(plans)

    def _complete(self, req: CpComplete) -> Ack:
        self.cluster.control.complete(self._take(req.iteration))
        return Ack()

    def _abort(self, req: CpAbort) -> Ack:
        self.cluster.control.abort(self._take(req.iteration))
        return Ack()

    def _take(self, iteration: int) -> Plans:
        plans = self._issued.pop(iteration, None)
        if plans is None:
            raise PlanError(f"iteration {iteration} has no plans in flight")
        return plans

    def _lease_prefix(self, req: CpLeasePrefix) -> CpLeased:
        return CpLeased(self.cluster.control.lease_prefix(req.request_id, req.tokens))

    def _finish(self, req: CpFinishRequest) -> Ack:
        self.cluster.control.finish_request(req.request_id)
        return Ack()

    def _stats(self, req: CpStats) -> CpStatsResult:
        control = self.cluster.control
        return CpStatsResult(control.stats(), tuple(control.instances), control.config.namespace,
                             control.config.segment_tokens)

    def _client_info(self, req: CpClientInfo) -> CpClientInfoResult:
        if req.instance not in self.cluster.control.instances:
            raise ConfigError(f"no instance {req.instance} in the pool")
        info = self.cluster.client_info(req.instance)
        buffers = {name: BufferSpec.from_dict(spec) for name, spec in info["buffers"].items()}
        return CpClientInfoResult(req.instance, dict(info["endpoints"]), buffers,
                                  float(info["timeout_s"]), info.get("keys"))


class Serialised:
    """Calls ``target``'s methods with ``lock`` held; ``get_prefix_tree`` returns the
    tree wrapped the same way (its ``match`` reads state the server's thread changes).
    Attributes that are not methods are read under the lock too."""

    def __init__(self, target: Any, lock: threading.RLock) -> None:
        self._target, self._lock = target, lock

    def __getattr__(self, name: str) -> Any:
        with self._lock:
            value = getattr(self._target, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                out = value(*args, **kwargs)
            return Serialised(out, self._lock) if name == "get_prefix_tree" else out

        return call

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
from tokenlake.core.errors import EngineUnavailable, TokenLakeError
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
    expect,
)
from tokenlake.dataplane.messages.base import M
from tokenlake.dataplane.shm import SharedTensor
from tokenlake.dataplane.sockets import send


def connect(address: str, timeout_s: float = 5.0,
            credentials: str | os.PathLike | dict | ClusterKeys | None = None) -> RemoteControlPlane:
    """The control plane served at ``address`` (``"tcp://HOST:PORT"``), connected.

    ``timeout_s`` bounds every wait for the server (seconds). ``credentials``: the file
    ``tokenlake serve`` wrote (or its content, or the keys); by default the one it wrote
    for this port on this machine (:mod:`tokenlake.dataplane.credentials`), and no CURVE if
    there is none. Connecting does not wait: a server that is not there, or that refuses
    the keys, shows at the first call, as ``EngineUnavailable``.
    """
    keys = credentials_load(credentials, address)
    return RemoteControlPlane(address, timeout_s, keys).start()


class RemotePrefixTree:
    """The read side of the served pool's prefix tree (``get_prefix_tree()``)."""

    def __init__(self, remote: RemoteControlPlane) -> None:
        self._remote = remote

    def match(self, token_ids: Sequence[int], max_tokens: int | None = None) -> MatchResult:
        """Longest prefix of ``token_ids`` made of ready segments
        (:meth:`~tokenlake.core.prefix_tree.PrefixTree.match`)."""
        request = CpMatch(tuple(int(t) for t in token_ids), max_tokens)
        return self._remote._call(request, CpMatched).match


class RemoteControlPlane:
    """A client of a :class:`~tokenlake.service.server.ControlServer` (see the module)."""

    def __init__(self, address: str, timeout_s: float = 5.0, keys: ClusterKeys | None = None) -> None:
        self.address, self.timeout_s, self.keys = address, timeout_s, keys
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._clients: dict[int, InstanceClient] = {}
        self._attached: list[SharedTensor] = []
        self._in_flight: set[int] = set()  # iterations planned here, not yet completed or aborted

    # ------------------------------------------------------------ lifecycle
    def start(self) -> RemoteControlPlane:
        """Connects the socket (does not wait for the server); returns ``self``."""
        if self._sock is None:
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            connect_secure(self._sock, self.keys)
            self._sock.connect(self.address)
        return self

    def close(self) -> None:
        """Aborts the plans this object got and did not complete or abort (best effort:
        a server that does not answer is given up after one timeout), closes the data-plane
        clients, unmaps their buffers and closes the socket."""
        self._abort_in_flight()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
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
        plans = self._call(CpGenPlans(tuple(batches), tuple(dops), homes), CpPlans).plans
        self._in_flight.add(plans.iteration)
        return plans

    def complete(self, plans: Plans) -> None:
        self._call(CpComplete(plans.iteration), Ack)
        self._in_flight.discard(plans.iteration)

    def abort(self, plans: Plans) -> None:
        self._call(CpAbort(plans.iteration), Ack)
        self._in_flight.discard(plans.iteration)

    def lease_prefix(self, request_id: str, prefix_token_ids: Sequence[int]) -> tuple[SegmentLocation, ...]:
        """:meth:`~tokenlake.core.control.ControlPlane.lease_prefix` on the server."""
        request = CpLeasePrefix(request_id, tuple(int(t) for t in prefix_token_ids))
        return self._call(request, CpLeased).locations

    def finish_request(self, request_id: str) -> None:
        self._call(CpFinishRequest(request_id), Ack)

    def stats(self) -> ControlStats:
        return self._call(CpStats(), CpStatsResult).stats

    @property
    def instances(self) -> tuple[int, ...]:
        """The ids of the pool's instances now (one round trip)."""
        return self._call(CpStats(), CpStatsResult).instances

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
                                    info.timeout_s, keys=keys)
            client.start(self._ctx)
            self._clients[instance] = client
        return self._clients[instance]

    def client_info(self, instance: int) -> CpClientInfoResult:
        """What opening ``instance``'s data-plane client needs: its engines' endpoints,
        its client buffers' specs and the cluster's wait limit (seconds)."""
        return self._call(CpClientInfo(instance), CpClientInfoResult)

    # ------------------------------------------------------------ internals
    def _abort_in_flight(self) -> None:
        while self._in_flight and self._sock is not None:
            iteration = self._in_flight.pop()
            try:
                self._call(CpAbort(iteration), Ack)
            except EngineUnavailable:  # no server to tell: it keeps them until it stops
                self._in_flight.clear()
            except TokenLakeError:  # completed or aborted meanwhile by someone else
                pass

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

"""The data-plane client a compute engine embeds (paper Figure 5).

One :class:`InstanceClient` per instance whose compute engine runs sub-batches there.
It owns no data: the ``q``, ``out`` and ``kv`` buffers are shared memory also mapped by
the instance's query and transfer engines, so handing work over is a small message.

    q_buf, kv_buf = client.init_plans(query_plan, transfer_plan)  # once per iteration
    for layer in range(num_layers):
        kv_buf[layer] = ...; handle = client.put(layer)  # asynchronous
        q_buf[:] = ...;      o, lse = client.query(layer)
    handle.wait()

Every wait has a timeout; a dead engine surfaces as
:class:`~tokenlake.core.errors.EngineUnavailable` within about ``poll_s`` of its death.

A client acts for one session (:mod:`tokenlake.dataplane.messages.session`): the owner's
in-process clients use the instance's own buffers, and a client of another process
(``tokenlake.connect``) uses its session's buffers, with its session's token as the
routing id of its sockets, so its plans never meet another client's.

:class:`~tokenlake.dataplane.segment_reader.SegmentReader` reads leased slots by message
instead.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable

import torch
import zmq

from tokenlake.core.errors import EngineUnavailable, PlanError
from tokenlake.core.plans import QueryPlan, TransferPlan
from tokenlake.dataplane import wire
from tokenlake.dataplane.auth import ClusterKeys, connect_secure
from tokenlake.dataplane.doorbell import ENGINE_SPIN_S, RING, ClientBell
from tokenlake.dataplane.messages import (
    PlanAck,
    Put,
    PutDone,
    Query,
    QueryDone,
    RegisterQueryPlan,
    RegisterTransferPlan,
    ReleasePlan,
    WireMessage,
    expect,
)
from tokenlake.dataplane.sockets import send_frames
from tokenlake.kernels.attention import Partial

log = logging.getLogger(__name__)


class PutHandle:
    """Completion of one layer's put; :meth:`wait` blocks until every store is done."""

    def __init__(self, client: InstanceClient, msg_id: int, layer: int, bell: bool = False) -> None:
        self._client, self._id, self.layer = client, msg_id, layer
        self._bell = bell  # msg_id is the seq of a hand-off on the session's bell
        self._done = False

    def wait(self, timeout_s: float | None = None) -> None:
        if not self._done:
            if self._bell:
                self._client._wait_bell("transfer", self._id, timeout_s)
            else:
                self._client._wait(self._id, timeout_s, PutDone)
            self._done = True

    def done(self) -> bool:
        """True once the put has completed (does not block; a failed put is done, and
        :meth:`wait` raises its error)."""
        if not self._done:
            if self._bell:
                state = self._client._bell.state("transfer", self._id)
                self._done = state > 0  # a failed one raises in wait()
                return state != 0
            if self._client._poll_done(self._id):
                self._done = True
        return self._done


class QueryHandle:
    """A query in flight; :meth:`wait` returns its merged
    :class:`~tokenlake.kernels.attention.Partial`: float32 views of the shared ``out``
    buffer, to consume before the next :meth:`InstanceClient.query`."""

    def __init__(self, client: InstanceClient, msg_id: int, out: Partial, bell: bool = False) -> None:
        self._client, self._id, self._out, self._bell = client, msg_id, out, bell

    def wait(self, timeout_s: float | None = None) -> Partial:
        if self._bell:
            self._client._wait_bell("query", self._id, timeout_s)
        else:
            self._client._wait(self._id, timeout_s, QueryDone)
        return self._out


class InstanceClient:
    """Compute-engine side of one instance's query and transfer engines."""

    _ids = itertools.count(1)

    def __init__(
        self,
        instance: int,
        endpoints: dict[str, str],
        buffers: dict[str, torch.Tensor],
        alive: Callable[[], str | None],
        timeout_s: float = 5.0,
        poll_s: float = 0.05,
        keys: ClusterKeys | None = None,
        routing_id: bytes | None = None,
        as_owner: bool = False,
        grant_for: Callable[[object], bytes] | None = None,
    ) -> None:
        self.instance = instance
        self.keys = keys  # CURVE keys: the member's pair is used (None: insecure cluster)
        self.routing_id = routing_id  # a client session's token or alias (its sockets' routing id)
        self.as_owner = as_owner  # the owner's in-process client (the instance's own buffers)
        # a client session's grant of a plan the control server gave it (b"": none known)
        self._grant_for = grant_for
        self.endpoints = endpoints
        self.q = buffers["q"]  # [max_rows, q_heads, head_dim]
        self.out_o = buffers["out_o"]
        self.out_lse = buffers["out_lse"]
        self.kv = buffers["kv"]  # [layers, max_rows, 2, kv_heads, head_dim]
        self._alive = alive
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._ctx: zmq.Context | None = None
        self._socks: dict[str, zmq.Socket] = {}
        self._poller: zmq.Poller | None = None
        self._replies: dict[int, wire.Message] = {}
        self._unawaited: set[int] = set()  # ids of releases, whose replies nobody reads
        self._query_plan: tuple[int, Partial] | None = None  # (plan id, its rows of out_o and out_lse)
        self._transfer_plan: tuple[int, int] | None = None
        self._registering: tuple[list, float] | None = None  # sent, replies not read yet (init_plans)
        self._puts: deque[PutHandle] = deque()  # not known to be done, in issue order
        # per-layer hand-offs through the session's shared bell (doorbell.py) when its
        # engines offer one; False: the socket path (``fast = False`` forces it)
        self.bell = self._bell_buf = buffers.get("bell")  # (uint8, host memory)
        self._bell: ClientBell | None = None
        self.fast = os.environ.get("TOKENLAKE_BELL", "1") != "0"  # an operator's switch to the socket path
        # see expect_query; pointless unless the engines spin for what they are told of
        self.heads_up = ENGINE_SPIN_S > 0 and os.environ.get("TOKENLAKE_BELL_HEADS_UP", "1") != "0"

    def start(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        for role in ("query", "transfer"):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.routing_id is not None:
                sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
            connect_secure(sock, self.keys, as_owner=self.as_owner)
            sock.connect(self.endpoints[role])
            self._socks[role] = sock

    def close(self) -> None:
        if self._bell is not None:
            self._bell.close()
            self._bell = None
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
        self._poller = None

    # ---------------------------------------------------------------- query
    def init_query(self, plan: QueryPlan) -> torch.Tensor:
        """Registers a sub-batch's query plan with the home query engine; ``q_buf``."""
        return self.init_plans(plan, None)[0]

    def init_plans(self, query: QueryPlan | None, transfer: TransferPlan | None, wait: bool = True) -> tuple:
        """Registers a sub-batch's query and transfer plans (either may be None), both sent
        before either reply is awaited (one round trip); returns ``(q_buf, kv_buf)``: the
        float32 [rows, q_heads, head_dim] view for q rows and the [layers, rows, 2,
        kv_heads, head_dim] view for new K/V (pool dtype; a float32 source is rounded),
        None for a plan not given. If one fails, the other is still taken, then it raises.
        ``wait=False`` returns once they are sent: the replies are read at the first
        :meth:`query_async`, :meth:`put` or :meth:`wait_puts` after it, which raises a
        refusal then, so the round trip overlaps the caller's work (the buffers may be
        written meanwhile)."""
        self._settle(quiet=True)  # an earlier registration nobody used: its replies read
        todo = [(role, plan, message) for role, plan, message in (
            ("query", query, RegisterQueryPlan), ("transfer", transfer, RegisterTransferPlan))
            if plan is not None]
        for _, plan, _ in todo:  # nothing is sent unless both can be
            self._check_home(plan.home)
        built = []
        for role, plan, message in todo:
            pid = next(self._ids)
            grant = self._grant_for(plan) if self._grant_for is not None else b""
            built.append((role, plan, pid, message.from_plan(pid, plan, grant)))
        sent = [(role, plan, pid, self._send(role, msg)) for role, plan, pid, msg in built]
        self._registering = (sent, time.monotonic() + self.timeout_s)  # one timeout for both
        if wait:
            self._settle()
        return (None if query is None else self.q[: query.num_rows],
                None if transfer is None else self.kv[:, : transfer.num_rows])

    def _settle(self, quiet: bool = False) -> None:
        """Reads the replies of the registrations :meth:`init_plans` sent last, if not yet:
        each plan taken becomes the role's current one (the one before it released);
        raises the first refusal or timeout (logs it with ``quiet``)."""
        if self._registering is None:
            return
        (sent, deadline), self._registering = self._registering, None
        error = None
        for role, plan, pid, msg_id in sent:
            try:
                self._wait(msg_id, max(deadline - time.monotonic(), self.poll_s), PlanAck)
            except Exception as e:  # the other registration's reply is still read
                error = error or e
                continue
            self._release(role)
            rows = plan.num_rows
            if role == "query":  # its rows of out are sliced once, not at every layer
                self._query_plan = (pid, Partial(self.out_o[:rows], self.out_lse[:rows]))
            else:
                self._transfer_plan = (pid, rows)
        if error is not None and quiet:
            log.debug("instance %d: an unused registration failed: %s", self.instance, error)
        elif error is not None:
            raise error

    def query(self, layer: int, timeout_s: float | None = None) -> Partial:
        """Prefix attention of ``q_buf`` over the pool for one layer."""
        return self.query_async(layer).wait(timeout_s)

    def expect_query(self) -> None:
        """Says a :meth:`query` comes soon (call it before computing the layer's q): with
        :attr:`heads_up` on (the default where ``TOKENLAKE_BELL_ENGINE_SPIN_US`` is set),
        the query engine wakes now and waits for it,
        spinning but yielding to any runnable thread, so its wake-up overlaps that work.
        Nothing on the socket path."""
        if self.heads_up and self._query_plan is not None and self._use_bell():
            self._bell.heads_up("query")

    def query_async(self, layer: int) -> QueryHandle:
        """Starts :meth:`query`; do other work (self-attention), then ``wait()``. Do not
        touch ``q_buf`` until it is done."""
        self._settle()
        if self._query_plan is None:
            raise PlanError("call init_query first")
        _index(layer, "layer", self.kv.shape[0])
        pid, out = self._query_plan
        _written(self.q)
        if self._use_bell():
            return QueryHandle(self, self._post("query", pid, layer, 1), out, bell=True)
        return QueryHandle(self, self._send("query", Query(pid, layer)), out)

    # ------------------------------------------------------------- transfer
    def init_transfer(self, plan: TransferPlan) -> torch.Tensor:
        """Registers a sub-batch's transfer plan with the home transfer engine; ``kv_buf``."""
        return self.init_plans(None, plan)[1]

    def put(self, layer: int, layers: int = 1) -> PutHandle:
        """Stores layers ``[layer, layer + layers)`` of ``kv_buf`` where the plan says,
        asynchronously (``layers > 1`` coalesces tiny decode puts into one message).

        Do not overwrite those layers of ``kv_buf`` before the handle is done."""
        self._settle()
        if self._transfer_plan is None:
            raise PlanError("call init_transfer first")
        _index(layer, "layer", self.kv.shape[0])
        _index(layers, "layers", self.kv.shape[0] + 1)
        if layers < 1 or layer < 0 or layer + layers > self.kv.shape[0]:
            raise PlanError(f"layers [{layer}, {layer + layers}) outside [0, {self.kv.shape[0]})")
        _written(self.kv)
        if self._use_bell():
            handle = PutHandle(self, self._post("transfer", self._transfer_plan[0], layer, layers), layer, True)
        else:
            handle = PutHandle(self, self._send("transfer", Put(self._transfer_plan[0], layer, layers)), layer)
        while self._puts and self._puts[0]._done:  # waited for by their owner already
            self._puts.popleft()
        self._puts.append(handle)
        return handle

    def wait_puts(self, timeout_s: float | None = None) -> None:
        """Waits until every put issued so far is stored (the per-batch completion: call
        it before reporting the iteration's plans complete to the control plane)."""
        self._settle()
        while self._puts:
            self._puts[0].wait(timeout_s)
            self._puts.popleft()

    # ------------------------------------------------------------ internals
    def _use_bell(self) -> bool:
        """True if hand-offs go through the session's bell (opened on first use)."""
        if not self.fast or self._bell_buf is None:
            return False
        if self._bell is None:
            self._bell = ClientBell.attach(self._bell_buf)
            if self._bell is None:  # engines without bells: the socket path, for good
                self._bell_buf = None
                return False
        return True

    def _post(self, role: str, plan: int, layer: int, layers: int) -> int:
        bell = self._bell
        assert bell is not None
        seq = bell.next_seq(role)
        if seq > RING and not bell.state(role, seq - RING):  # its entry is still in use
            self._wait_bell(role, seq - RING, None)
        return bell.post(role, plan, layer, layers)

    def _wait_bell(self, role: str, seq: int, timeout_s: float | None) -> None:
        assert self._bell is not None
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        self._bell.wait(role, seq, deadline, self.poll_s, self._alive, self.instance)

    def _check_home(self, home: int) -> None:
        if home != self.instance:
            raise PlanError(f"plan is homed on instance {home}; this client is instance {self.instance}")

    def _release(self, role: str) -> None:
        """Releases the role's current plan without waiting (its reply is dropped)."""
        old = self._query_plan if role == "query" else self._transfer_plan
        if old is not None:
            self._unawaited.add(self._send(role, ReleasePlan(old[0])))

    def _send(self, role: str, message: WireMessage) -> int:
        msg_id = next(self._ids)
        send_frames(self._socks[role], message.encode(msg_id))
        return msg_id

    def _drain(self, wait_ms: int) -> bool:
        """Files every reply that arrives within ``wait_ms``; True if any did."""
        if self._poller is None:
            self._poller = zmq.Poller()
            for sock in self._socks.values():
                self._poller.register(sock, zmq.POLLIN)
        got = False
        for sock, _ in self._poller.poll(wait_ms):
            while sock.poll(0):
                msg = wire.decode(sock.recv_multipart(copy=False))
                if msg.msg_id in self._unawaited:
                    self._unawaited.discard(msg.msg_id)
                else:
                    self._replies[msg.msg_id] = msg
                got = True
        return got

    def _poll_done(self, msg_id: int) -> bool:
        self._drain(0)
        return msg_id in self._replies

    def _wait(self, msg_id: int, timeout_s: float | None, reply: type[WireMessage]) -> WireMessage:
        """The reply to ``msg_id``, read as a ``reply``; an ``ERROR`` raises its typed
        exception, silence past the timeout or a dead engine ``EngineUnavailable``."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while msg_id not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineUnavailable(f"no reply from instance {self.instance}'s engines within the timeout")
            if not self._drain(int(min(left, self.poll_s) * 1000) + 1):
                dead = self._alive()  # quiet for poll_s: is anyone there?
                if dead is not None:
                    raise EngineUnavailable(f"{dead} is not running")
        return expect(self._replies.pop(msg_id), reply)


def _index(value, name: str, bound: int) -> int:
    """``value`` if it is an int in ``[0, bound)`` (never a bool, a float or a string:
    ``query(1.7)`` must not mean layer 1); else :class:`PlanError`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name} must be an int, got {value!r}")
    if not 0 <= value < bound:
        raise PlanError(f"{name} {value} outside [0, {bound})")
    return value


def _written(buf: torch.Tensor) -> None:
    """On a GPU pool the caller's writes into ``buf`` may still be queued on its CUDA
    stream, while the engine that reads the buffer (another process, by IPC handle) sees
    only device memory: wait for them before the message that lets the engine read."""
    if buf.is_cuda:
        torch.cuda.current_stream(buf.device).synchronize()

"""Leased slots read from an instance's transfer engine by message (``READ_SEGMENT``,
answered by ``SEGMENT_DATA``): the data comes in the reply, so the reader maps none of
the instance's buffers and works from any machine that reaches the engine (the vLLM
connector's load mode)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import zmq

from tokenlake.core.errors import EngineUnavailable, TokenLakeError
from tokenlake.dataplane import wire
from tokenlake.dataplane.auth import ClusterKeys, connect_secure
from tokenlake.dataplane.messages import ReadSegment, SegmentData, expect
from tokenlake.dataplane.sockets import send


class SegmentReader:
    """Layers of slots read from one instance's transfer engine by message: ``READ_SEGMENT``
    answered by ``SEGMENT_DATA``, on a DEALER socket of its own (one per routing id and
    engine: a ROUTER takes one connection per routing id). :meth:`read` sends without
    waiting; :meth:`receive` takes the replies in the order the reads were sent, as the
    engine answers them (so after giving up on a read, close the reader: its late reply
    must not be taken for the next one's). For one thread, as :class:`InstanceClient`."""

    def __init__(self, instance: int, endpoint: str, keys: ClusterKeys | None = None,
                 routing_id: bytes | None = None) -> None:
        self.instance, self.endpoint, self.keys, self.routing_id = instance, endpoint, keys, routing_id
        self._sock: zmq.Socket | None = None
        self._ids = itertools.count(1)

    def start(self, ctx: zmq.Context) -> SegmentReader:
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if self.routing_id is not None:
            self._sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        connect_secure(self._sock, self.keys)
        self._sock.connect(self.endpoint)
        return self

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Closes the socket, dropping the replies still owed; idempotent."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def read(self, layer: int, slots: Sequence[int], grant: bytes = b"", timeout_s: float = 5.0) -> int:
        """Asks for ``layer`` of ``slots`` (a client session names the slots a lease of it
        granted on this instance, with that grant) without waiting; returns the read's
        message id. No room to send within ``timeout_s`` raises ``EngineUnavailable``."""
        if self._sock is None:
            raise EngineUnavailable(f"the reader of instance {self.instance} is closed")
        msg_id = next(self._ids)
        send(self._sock, ReadSegment(layer, tuple(slots), grant).encode(msg_id), timeout_s=timeout_s)
        return msg_id

    def receive(self, msg_id: int, timeout_s: float) -> tuple[torch.Tensor, ...]:
        """The blocks read ``msg_id`` asked for, the oldest read not yet received: one per
        slot, in its order, ``[2, kv_heads, C, head_dim]`` in the slab's dtype (views of
        the reply). An ``ERROR`` reply raises its typed exception (``NotAuthorized``: the
        lease's grant no longer holds), silence for ``timeout_s`` seconds
        ``EngineUnavailable``, a reply to another message ``TokenLakeError``."""
        if self._sock is None:
            raise EngineUnavailable(f"the reader of instance {self.instance} is closed")
        reply = wire.recv(self._sock, timeout_s)
        if reply.msg_id != msg_id:
            raise TokenLakeError(f"instance {self.instance} answered message {reply.msg_id}, "
                                 f"expected {msg_id}")
        return expect(reply, SegmentData).blocks

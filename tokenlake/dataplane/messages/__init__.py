"""Typed wire messages: one frozen dataclass per :class:`~tokenlake.dataplane.wire.Kind`.

    frames = Query(plan=3, layer=0).encode(msg_id)        # one wire.encode
    message = parse(wire.decode(frames))                  # -> Query(plan=3, layer=0)
    done = expect(reply, QueryDone)                       # ERROR -> its typed exception

Each class validates its own body when read (:func:`parse`): a malformed one raises
:class:`~tokenlake.dataplane.tensor_frames.WireError` whose text starts with the kind and
names the field, and whose ``field`` is the field's path. Peer traffic between engines
has its own kinds (``PEER_*``), and so has a control-plane server's traffic (``CP_*``,
:mod:`~tokenlake.dataplane.messages.service`), so nothing is told apart by which keys a
body has, and plan items travel as typed objects (:class:`AttendItem`, :class:`PutTarget`,
:class:`SlotWrite`) from the client's plan to the peer that attends or stores.
``docs/protocol.md`` is the spec of every kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from tokenlake.dataplane import wire
from tokenlake.dataplane.messages.base import TYPES, Fields, WireMessage
from tokenlake.dataplane.messages.control import (
    Ack,
    ErrorReply,
    Peers,
    Ping,
    PlanAck,
    Pong,
    ReleasePlan,
    Shutdown,
)
from tokenlake.dataplane.messages.query import (
    AttendItem,
    InstanceItems,
    PeerQuery,
    PeerQueryResult,
    PeerRegisterPlan,
    PeerReleasePlan,
    Query,
    QueryDone,
    RegisterQueryPlan,
)
from tokenlake.dataplane.messages.service import (
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
    SessionInfo,
)
from tokenlake.dataplane.messages.session import (
    Adopt,
    CloseSession,
    CpCloseSession,
    CpHeartbeat,
    CpOpenSession,
    CpSession,
    OpenSession,
    Retire,
)
from tokenlake.dataplane.messages.tier import (
    TierDone,
    TierEntry,
    TierList,
    TierListing,
    TierOps,
    TierProgress,
    TierRead,
)
from tokenlake.dataplane.messages.transfer import (
    CopyDone,
    CopySegment,
    PeerPut,
    PeerSegment,
    Put,
    PutDone,
    PutTarget,
    ReadSegment,
    RegisterTransferPlan,
    SegmentData,
    SlotCopy,
    SlotWrite,
)
from tokenlake.dataplane.tensor_frames import WireError

__all__ = [
    "TYPES", "Ack", "Adopt", "AttendItem", "CloseSession", "CopyDone", "CopySegment", "CpAbort",
    "CpCacheLoad", "CpClientInfo", "CpClientInfoResult", "CpCloseSession", "CpComplete",
    "CpFinishRequest", "CpGenPlans", "CpHeartbeat", "CpLeased", "CpLeasePrefix", "CpLoad",
    "CpMatch", "CpMatched", "CpOpenSession", "CpPlans", "CpSession", "CpStats",
    "CpStatsResult", "ErrorReply", "Fields", "OpenSession", "Retire", "SessionInfo",
    "InstanceItems", "PeerPut", "PeerQuery", "PeerQueryResult", "PeerRegisterPlan",
    "PeerReleasePlan", "PeerSegment", "Peers", "Ping", "PlanAck", "Pong", "Put", "PutDone",
    "PutTarget", "Query", "QueryDone", "ReadSegment", "RegisterQueryPlan",
    "RegisterTransferPlan", "ReleasePlan", "SegmentData", "Shutdown", "SlotCopy", "SlotWrite",
    "TierDone", "TierEntry", "TierList", "TierListing", "TierOps", "TierProgress", "TierRead", "WireMessage", "decode", "expect", "parse",
]

M = TypeVar("M", bound=WireMessage)


def parse(msg: wire.Message) -> WireMessage:
    """The typed message of a decoded one (an ``ERROR`` becomes :class:`ErrorReply`).

    Raises:
        WireError: the body does not fit the kind's schema; ``msg_id`` and ``field`` set.
    """
    try:
        return TYPES[msg.kind].from_wire(Fields(msg.kind, msg.body, msg.tensors))
    except WireError as e:
        e.msg_id = msg.msg_id
        raise


def decode(frames: Sequence) -> tuple[int, WireMessage]:
    """``(msg_id, typed message)`` of one message's frames (:func:`wire.decode` +
    :func:`parse`); raises :class:`WireError` on anything malformed."""
    msg = wire.decode(frames)
    return msg.msg_id, parse(msg)


def expect(msg: wire.Message, cls: type[M]) -> M:
    """The reply ``msg`` as a ``cls``; an ``ERROR`` raises its typed exception
    (:func:`wire.raise_if_error`), another kind raises :class:`WireError`."""
    reply = parse(wire.raise_if_error(msg))
    if not isinstance(reply, cls):
        raise WireError(f"expected {cls.KIND.name} in reply to message {msg.msg_id}, got {msg.kind.name}")
    return reply


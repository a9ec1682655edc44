"""Messages every engine answers (0x) and the driver's lifecycle messages (3x).

Bodies are given as msgpack maps; ``docs/protocol.md`` is the spec of each.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenlake.core.errors import TokenLakeError
from tokenlake.dataplane.messages.base import Fields, WireMessage
from tokenlake.dataplane.tensor_frames import short
from tokenlake.dataplane.wire import Kind, remote_exception

MAX_ENDPOINT_CHARS = 255  # longest engine endpoint a PEERS entry may carry


@dataclass(frozen=True)
class Ping(WireMessage):
    """``PING`` ``{}``: anyone to an engine; answered with :class:`Pong`."""

    KIND = Kind.PING


@dataclass(frozen=True)
class Pong(WireMessage):
    """``PONG``: the answering engine's identity and counters (``EngineLoop.stats``).

    Body ``{"role", "instance", "bytes_copied", "messages_copied", "requests",
    "busy_s", "handoffs"}``: role ``"query"`` or ``"transfer"``; payload bytes its decodes
    copied and the messages that needed a copy (``CopyStats``); requests served; seconds
    spent handling messages (not waiting); hand-offs served from the sessions' bells
    (doorbell.py; optional, 0 when absent).
    """

    KIND = Kind.PONG
    role: str
    instance: int
    bytes_copied: int
    messages_copied: int
    requests: int
    busy_s: float
    handoffs: int = 0

    def body(self) -> dict:
        return {"role": self.role, "instance": self.instance, "bytes_copied": self.bytes_copied,
                "messages_copied": self.messages_copied, "requests": self.requests,
                "busy_s": self.busy_s, "handoffs": self.handoffs}

    @classmethod
    def from_wire(cls, f: Fields) -> Pong:
        f.tensors(0)
        return cls(f.str("role"), f.int("instance"), f.int("bytes_copied"),
                   f.int("messages_copied"), f.int("requests"), f.float("busy_s"),
                   f.int("handoffs", default=0))


@dataclass(frozen=True)
class ErrorReply(WireMessage):
    """``ERROR`` ``{"type": exception class name, "message": str, "request_ids": [str]
    (optional)}``: the answer to any request that failed (built by
    ``wire.error_message``); ``request_ids`` names the requests a ``SegmentInFlight``
    keeps waiting."""

    KIND = Kind.ERROR
    type: str
    message: str
    request_ids: tuple[str, ...] = ()  # optional: the requests an error names

    def body(self) -> dict:
        body = {"type": self.type, "message": self.message}
        if self.request_ids:
            body["request_ids"] = list(self.request_ids)
        return body

    @classmethod
    def from_wire(cls, f: Fields) -> ErrorReply:
        f.tensors(0)
        rids = f.list("request_ids", default=[])
        for i, r in enumerate(rids):
            if not isinstance(r, str):
                raise f.error(f"request_ids[{i}]", f"must be a str, got {short(r)}")
        return cls(f.str("type"), f.str("message"), tuple(rids))

    def exception(self) -> TokenLakeError:
        """The typed exception this error stands for (``wire.raise_if_error``'s rules)."""
        return remote_exception(self.type, self.message, list(self.request_ids) or None)


@dataclass(frozen=True)
class Ack(WireMessage):
    """``ACK`` ``{}``: done, nothing to report (the answer to ``SHUTDOWN`` and ``PEERS``)."""

    KIND = Kind.ACK


@dataclass(frozen=True)
class ReleasePlan(WireMessage):
    """``RELEASE_PLAN`` ``{"plan": int}``: a client drops a plan it registered with its
    query or transfer engine (an unknown id is no error). Answered with :class:`PlanAck`."""

    KIND = Kind.RELEASE_PLAN
    plan: int

    def body(self) -> dict:
        return {"plan": self.plan}

    @classmethod
    def from_wire(cls, f: Fields) -> ReleasePlan:
        f.tensors(0)
        return cls(f.int("plan"))


@dataclass(frozen=True)
class PlanAck(WireMessage):
    """``PLAN_ACK`` ``{"plan": int}``: a plan was registered or released; echoes its id."""

    KIND = Kind.PLAN_ACK
    plan: int

    def body(self) -> dict:
        return {"plan": self.plan}

    @classmethod
    def from_wire(cls, f: Fields) -> PlanAck:
        f.tensors(0)
        return cls(f.int("plan"))


@dataclass(frozen=True)
class Shutdown(WireMessage):
    """``SHUTDOWN`` ``{}``: the driver stops an engine; answered with :class:`Ack`, then
    the engine's loop ends."""

    KIND = Kind.SHUTDOWN


@dataclass(frozen=True)
class Peers(WireMessage):
    """``PEERS`` ``{"peers": [[instance, endpoint or nil], ...]}`` (non-empty): the
    driver tells an engine the addresses of peers of its role; it replaces its socket to
    each named instance (nil forgets it). Sent when an instance is removed or restarted
    at a new address. Answered with :class:`Ack`.

    ``peers``: ``(instance, "tcp://host:port" or None)`` pairs.
    """

    KIND = Kind.PEERS
    peers: tuple[tuple[int, str | None], ...]

    def body(self) -> dict:
        return {"peers": [[inst, ep] for inst, ep in self.peers]}

    @classmethod
    def from_wire(cls, f: Fields) -> Peers:
        f.tensors(0)
        raw = f.body.get("peers")
        if not isinstance(raw, list) or not raw:
            raise f.error("peers", f"must be a non-empty list of [instance, endpoint], got {short(raw)}")
        peers = []
        for i, entry in enumerate(raw):
            path = f"peers[{i}]"
            if not (isinstance(entry, list) and len(entry) == 2):
                raise f.error(path, f"is a malformed entry {short(entry)}")
            inst, ep = f.as_int(entry[0], f"{path}[0]"), entry[1]
            if ep is not None and not (isinstance(ep, str) and ep.startswith("tcp://")
                                       and len(ep) <= MAX_ENDPOINT_CHARS):
                raise f.error(f"{path}[1]", f"of instance {inst} is not a tcp endpoint: {short(ep)}")
            peers.append((inst, ep))
        return cls(tuple(peers))

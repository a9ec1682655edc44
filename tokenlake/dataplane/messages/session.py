"""Client sessions: a control-plane server's clients (8x) and the driver's session
messages to engines (3x).

Every client of a served pool (a ``tokenlake.connect`` caller, a vLLM connector worker)
is a **session** (docs/design.md §10): it owns its own ``q``/``out``/``kv`` buffers on
each instance it computes on, its plans live in its own namespace on the engines, and
the server ends it, aborting what it left in flight, when it stops heartbeating.

A session is named by its **token**: 16 bytes, ``b"S"`` first, that the client draws
at random (or derives from a secret its processes share, :func:`token_for`). The
client's sockets (to the control port and to the engines) carry it as their ZeroMQ
routing id, so neither the server nor an engine reads it from a message body: a request
arriving on a connection whose routing id is a session's token (or an :func:`alias` of
it) is that session's. On a pool with CURVE the token travels only encrypted.

A ROUTER takes one connection per routing id, so the processes of one session (vLLM's
scheduler and worker) and a process's second socket to an engine connect with aliases:
the token and one byte.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from tokenlake.dataplane.messages.base import WireMessage
from tokenlake.dataplane.messages.service import _PlainBody
from tokenlake.dataplane.shm_files import BufferSpec
from tokenlake.dataplane.wire import Kind

#: bytes of a session token (the routing id of the session's sockets)
TOKEN_BYTES = 16
#: a session token's first byte (ZeroMQ reserves routing ids that start with a zero byte)
TOKEN_MARK = b"S"


def new_token() -> bytes:
    """A fresh session token: :data:`TOKEN_MARK` and 15 random bytes."""
    return TOKEN_MARK + os.urandom(TOKEN_BYTES - 1)


def token_for(secret: str) -> bytes:
    """The session token every process holding ``secret`` derives alike (the vLLM
    connector's scheduler and worker share their engine id): :data:`TOKEN_MARK` and 15
    bytes of a keyed hash of it. As guessable as ``secret``: keep it random."""
    digest = hashlib.blake2b(secret.encode(), digest_size=TOKEN_BYTES - 1, person=b"tokenlake-sess")
    return TOKEN_MARK + digest.digest()


def is_token(raw: bytes) -> bool:
    """Whether ``raw`` (a routing id) has the form of a session token."""
    return len(raw) == TOKEN_BYTES and raw[:1] == TOKEN_MARK


def alias(token: bytes, n: int) -> bytes:
    """The routing id of a session's ``n``-th extra connection (1..255): its token and one
    byte. A ROUTER takes one connection per routing id, so a session whose processes
    share it, or that talks to an engine over a second socket (the vLLM connector's
    reads), connects with these."""
    if not 1 <= n <= 255:
        raise ValueError(f"alias number must be in [1, 255], got {n}")
    return token + bytes((n,))


def session_of(routing_id: bytes) -> bytes | None:
    """The session token a routing id stands for (itself, or what it is an
    :func:`alias` of); None when it is no session's."""
    if len(routing_id) in (TOKEN_BYTES, TOKEN_BYTES + 1) and routing_id[:1] == TOKEN_MARK:
        return routing_id[:TOKEN_BYTES]
    return None


@dataclass(frozen=True)
class OpenSession(_PlainBody, WireMessage):
    """``OPEN_SESSION`` ``{"token": bin, "buffers": [[name, BufferSpec]]}``: the driver
    (owner only) tells an engine that requests on connections with routing id ``token``
    are a session's, whose buffers these are (a query engine's ``q``, ``out_o``,
    ``out_lse``; a transfer engine's ``kv``: the shapes of the instance's own). Answered
    with ``ACK``."""

    KIND = Kind.OPEN_SESSION
    token: bytes
    buffers: Mapping[str, BufferSpec]


@dataclass(frozen=True)
class CloseSession(_PlainBody, WireMessage):
    """``CLOSE_SESSION`` ``{"token": bin}``: the driver (owner only) ends a session on an
    engine: its plans go, its buffers are unmapped, later requests with its token are
    refused. Answered with ``ACK`` once nothing the session started is still running
    there (a put waiting for its peers is finished or failed first), so no write of the
    session lands after the answer."""

    KIND = Kind.CLOSE_SESSION
    token: bytes


@dataclass(frozen=True)
class Retire(_PlainBody, WireMessage):
    """``RETIRE`` ``{"token": bin, "grants": [int]}``: the driver (owner only) tells an
    engine that these grants of a session are spent (an iteration completed or aborted,
    a lease finished): its plans under them go, and they are refused from now on
    (:mod:`tokenlake.dataplane.grants`). Answered with ``ACK`` once done, so nothing the
    retired plans name is touched after the answer."""

    KIND = Kind.RETIRE
    token: bytes
    grants: tuple[int, ...]


@dataclass(frozen=True)
class Adopt(_PlainBody, WireMessage):
    """``ADOPT`` ``{"owner_pid": int, "grant_key": bin | nil}``: a new control process
    (owner keys only) takes over an engine whose owner died (docs/design.md §4
    "Restart"): the engine stops waiting out its grace, watches ``owner_pid`` from now
    on, and checks client sessions' grants with ``grant_key`` (a fresh one: no grant
    the dead owner signed is taken again; nil: none). Refused while the old owner
    lives. Answered with ``ACK``."""

    KIND = Kind.ADOPT
    owner_pid: int
    grant_key: bytes | None = None


@dataclass(frozen=True)
class CpOpenSession(_PlainBody, WireMessage):
    """``CP_OPEN_SESSION`` ``{"pid": int, "label": str}``: a client opens its session on
    the connection whose routing id is its token (or joins it, on an :func:`alias`, if
    another of its processes opened it already); answered with :class:`CpSession`."""

    KIND = Kind.CP_OPEN_SESSION
    pid: int
    label: str


@dataclass(frozen=True)
class CpSession(_PlainBody, WireMessage):
    """``CP_SESSION`` ``{"session": int, "heartbeat_s": float, "timeout_s": float}``: the
    session's number; send ``CP_HEARTBEAT`` every ``heartbeat_s`` seconds (any request
    counts): the server ends a session silent for ``timeout_s``."""

    KIND = Kind.CP_SESSION
    session: int
    heartbeat_s: float
    timeout_s: float


@dataclass(frozen=True)
class CpHeartbeat(_PlainBody, WireMessage):
    """``CP_HEARTBEAT`` ``{}``: the session is alive; answered with ``ACK`` (``ERROR``
    ``NotAuthorized`` once the server has ended it)."""

    KIND = Kind.CP_HEARTBEAT


@dataclass(frozen=True)
class CpCloseSession(_PlainBody, WireMessage):
    """``CP_CLOSE_SESSION`` ``{}``: the client leaves its session; when the last of its
    connections left, the session ends (what it left in flight is aborted, its requests
    finished, its buffers unlinked). Answered with ``ACK``."""

    KIND = Kind.CP_CLOSE_SESSION

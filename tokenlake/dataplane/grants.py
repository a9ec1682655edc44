"""Grants: what the control plane allowed a client session to do on an engine.

A client session registers its plans with its instance's engines itself (docs/design.md
§10), so an engine must be able to tell a plan the control plane made for that session
from one the session made up (naming slots that hold another client's segments, to read
or overwrite them). The control server therefore signs every plan it hands a session,
and every lease it gives one to read: a **grant** is a keyed hash (blake2b, 16 bytes)
over the session's token, the grant's id, when it was issued, its kind, and the plan's
own content as the engine reads it, under a key only the owner and the engines hold
(``ClusterBase.grant_key``; members never see it).

An engine accepts a client session's ``REGISTER_QUERY_PLAN``, ``REGISTER_TRANSFER_PLAN``
and ``READ_SEGMENT`` only with a grant that verifies for that session and that content,
was issued at most ``ttl_s`` ago, and has not been retired: the server retires a plan's
grant (``RETIRE``) when its iteration is completed or aborted, and a lease's when its
request is finished, so a plan cannot be used after the slots it names may have gone to
someone else. A grant's id is ``2 * iteration`` for a plan and an odd number for a lease.

Wire form: 32 bytes, ``id`` (8, big-endian), ``issued_ms`` (8, big-endian, wall-clock
milliseconds), then the 16-byte MAC. The owner's own clients (the serving process,
Ray's compute actors) need none.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time

import msgpack

from tokenlake.core.errors import NotAuthorized

GRANT_BYTES = 32
_MAC_BYTES = 16
_HEAD = struct.Struct(">QQ")
#: How long a grant may be used after it was issued (seconds): the control server's
#: iteration timeout; a session with an iteration in flight longer is ended anyway.
GRANT_TTL_S = 120.0
#: How far an issue time may lie in the future (clocks of the server's and an engine's
#: machines differ a little).
CLOCK_SKEW_S = 5.0

QUERY_PLAN, TRANSFER_PLAN, READ = b"q", b"t", b"r"


def plan_grant_id(iteration: int) -> int:
    """The grant id of the plans of ``iteration``."""
    return 2 * iteration


def lease_grant_id(number: int) -> int:
    """The grant id of the ``number``-th lease the server signs."""
    return 2 * number + 1


def payload(body: dict) -> bytes:
    """The bytes a grant covers of a message body: every field but the client's own
    plan id and the grant itself, msgpack-encoded in the body's field order (the same on
    both sides: both build the body from the typed message)."""
    return msgpack.packb({k: v for k, v in body.items() if k not in ("plan", "grant")})


def sign(key: bytes, token: bytes, grant_id: int, kind: bytes, content: bytes,
         now_s: float | None = None) -> bytes:
    """A grant for session ``token`` to use ``content`` (a :func:`payload`) of ``kind``."""
    issued_ms = int((time.time() if now_s is None else now_s) * 1000)
    head = _HEAD.pack(grant_id, issued_ms)
    return head + _mac(key, token, head, kind, content)


def verify(key: bytes, token: bytes, grant: bytes, kind: bytes, content: bytes,
           ttl_s: float = GRANT_TTL_S, now_s: float | None = None) -> tuple[int, float]:
    """``(grant id, expiry in wall-clock seconds)`` of a grant that is valid for session
    ``token``, ``kind`` and ``content`` now; :class:`NotAuthorized` otherwise."""
    if len(grant) != GRANT_BYTES:
        raise NotAuthorized(f"a client session's {_name(kind)} needs the control server's grant")
    head, mac = grant[:16], grant[16:]
    if not hmac.compare_digest(mac, _mac(key, token, head, kind, content)):
        raise NotAuthorized(f"this {_name(kind)} is not one the control server granted this session")
    grant_id, issued_ms = _HEAD.unpack(head)
    now = time.time() if now_s is None else now_s
    issued = issued_ms / 1000.0
    if issued > now + CLOCK_SKEW_S or now > issued + ttl_s:
        raise NotAuthorized(f"the grant of this {_name(kind)} expired (issued {now - issued:.0f} s ago)")
    return grant_id, issued + ttl_s


def _mac(key: bytes, token: bytes, head: bytes, kind: bytes, content: bytes) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=_MAC_BYTES, person=b"tokenlake-grant")
    for part in (kind, token, head, content):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


def _name(kind: bytes) -> str:
    return {QUERY_PLAN: "query plan", TRANSFER_PLAN: "transfer plan", READ: "read"}.get(kind, "request")

"""What an engine knows of who sent a request: the caller, its session, and the grants
that let a client session's plans and reads in (docs/design.md §10).

:class:`EngineSessions` is the part of :class:`~tokenlake.engines.loop.EngineLoop`
that keeps client sessions: their buffers (``OPEN_SESSION``), their end
(``CLOSE_SESSION``), their spent grants (``RETIRE``), and the checks every request
passes before it is served: the lifecycle kinds from the cluster's owner only, the
peer kinds from another engine only, a plan operation in the caller's own session, a
session's plan or read only with the control server's grant
(:mod:`tokenlake.dataplane.grants`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenlake.core.errors import NotAuthorized, PlanError
from tokenlake.dataplane import grants
from tokenlake.dataplane.auth import ENGINE, OWNER, sender
from tokenlake.dataplane.messages import (
    Ack,
    Adopt,
    CloseSession,
    CopySegment,
    OpenSession,
    PeerPut,
    PeerQuery,
    PeerRegisterPlan,
    PeerReleasePlan,
    Peers,
    PeerSegment,
    Retire,
    Shutdown,
    TierList,
    TierOps,
    TierRead,
    WireMessage,
)
from tokenlake.dataplane.messages.session import session_of
from tokenlake.dataplane.shm import SharedTensor
from tokenlake.dataplane.shm_files import BufferSpec

#: The kinds only the cluster's owner may send.
OWNER_KINDS = (Shutdown, Peers, OpenSession, CloseSession, CopySegment, Retire, Adopt, TierOps, TierRead,
               TierList)
#: The kinds only another engine of the cluster may send.
PEER_KINDS = (PeerRegisterPlan, PeerReleasePlan, PeerQuery, PeerPut, PeerSegment)
#: Client sessions one engine serves at once (the control server bounds them lower).
MAX_SESSIONS = 256
#: The owner's own session: its in-process clients use the instance's buffers.
OWNER_SESSION = b""


@dataclass(frozen=True)
class Caller:
    """Who sent the request being served.

    ``who``: the CURVE principal (``"owner"``, ``"member"``, ``"engine"``; ``None``
    without CURVE). ``session``: the session whose buffers and plans a plan operation
    uses: a client session's token, :data:`OWNER_SESSION` for the owner (and for anyone
    on a pool without CURVE that is not a session), ``None`` for a sender with no
    session (a member that opened none, or an engine).
    """

    who: str | None
    session: bytes | None

    def require_session(self) -> bytes:
        """The caller's session, or :class:`NotAuthorized` if it has none."""
        if self.session is None:
            raise NotAuthorized("plan operations need a session: open one with the pool's "
                                "control server (tokenlake.connect does)")
        return self.session


class EngineSessions:
    """Client sessions of one engine (a mixin of ``EngineLoop``, which provides
    ``spec``, ``keys``, ``_pending`` and ``reply``)."""

    def _init_sessions(self) -> None:
        # session token -> its buffers by name (the owner's session: the instance's own,
        # filled by map_buffers); the mappings of client sessions, to close with them
        self.sessions: dict[bytes, dict[str, torch.Tensor]] = {}
        self._session_maps: dict[bytes, list[SharedTensor]] = {}
        # token -> (identity, msg id, close?) of CLOSE_SESSIONs and RETIREs to answer once
        # nothing the session started waits for a peer
        self._closing: dict[bytes, list[tuple[Any, int, bool]]] = {}
        self._retired: dict[bytes, dict[int, float]] = {}  # token -> grant id -> when it expires
        self.grant_key: bytes | None = self.spec.grant_key  # a new owner brings its own (ADOPT)

    def _close_session_maps(self) -> None:
        for maps in self._session_maps.values():
            for m in maps:
                m.close()

    def _caller(self, identity, first_frame) -> Caller:
        """Who sent a request: the CURVE principal of its first frame and the session of
        its routing id (see :class:`Caller`)."""
        who = sender(first_frame) if self.keys is not None else None
        token = session_of(identity.bytes if hasattr(identity, "bytes") else bytes(identity))
        if token is not None and token in self.sessions:
            return Caller(who, token)
        return Caller(who, OWNER_SESSION if who in (OWNER, None) else None)

    def _authorize(self, caller: Caller, message: WireMessage) -> None:
        """Refuses (``NotAuthorized``) a lifecycle kind from anyone but the owner and a
        peer kind from anyone but an engine (with CURVE; a client session never sends
        either)."""
        session = caller.session not in (None, OWNER_SESSION)
        if isinstance(message, OWNER_KINDS) and (session or caller.who not in (OWNER, None)):
            raise NotAuthorized(f"only the cluster's owner may send {message.KIND.name}")
        if isinstance(message, PEER_KINDS) and (session or caller.who not in (ENGINE, None)):
            raise NotAuthorized(f"only an engine of the cluster may send {message.KIND.name}")

    def _open_session(self, message: OpenSession) -> None:
        """Maps a client session's buffers (the shapes of the instance's own)."""
        token = message.token
        if token in self.sessions:
            raise PlanError("a session with this token is open already")
        if len(self.sessions) > MAX_SESSIONS:
            raise PlanError(f"this engine serves {MAX_SESSIONS} sessions at most")
        own = {n: BufferSpec.from_dict(d) for n, d in self.spec.buffers.items() if n != "slab"}
        if not set(own) - {"bell"} <= set(message.buffers) <= set(own):  # without a bell: the socket path
            raise PlanError(f"a session of a {self.spec.role} engine needs the buffers "
                            f"{sorted(own)}, got {sorted(message.buffers)}")
        for name, spec in message.buffers.items():
            mine = own[name]
            if (spec.shape, spec.dtype, spec.device) != (mine.shape, mine.dtype, mine.device):
                raise PlanError(f"session buffer {name} is {spec.dtype} {spec.shape} on "
                                f"{spec.device}; this instance's is {mine.dtype} {mine.shape}")
        maps: list[SharedTensor] = []
        try:
            for spec in message.buffers.values():
                maps.append(SharedTensor.attach(spec))
        except Exception:
            for m in maps:
                m.close()
            raise
        self.sessions[token] = {name: m.tensor for name, m in zip(message.buffers, maps)}
        self._session_maps[token] = maps
        self.open_bell(token, self.sessions[token].get("bell"), message.buffers.get("bell"))

    def _close_session(self, identity, msg_id: int, token: bytes) -> None:
        """Ends a session here: its plans go at once (:meth:`drop_session`); the answer
        (and the unmapping) waits until no request it started is waiting for a peer."""
        if token == OWNER_SESSION:
            raise PlanError("the owner's session cannot be closed")
        if token not in self.sessions:  # closed already (or never opened here): done
            self.reply(identity, Ack().encode(msg_id))
            return
        self.drop_session(token)
        self._retired.pop(token, None)
        self._closing.setdefault(token, []).append((identity, msg_id, True))
        self._settle_closing()

    def _retire(self, identity, msg_id: int, message: Retire) -> None:
        """Spends grants of a session: its plans under them go at once, the grants are
        refused from now on, and the answer waits until no request of the session is
        waiting for a peer (as a close does)."""
        token = message.token
        if token not in self.sessions or token == OWNER_SESSION:
            self.reply(identity, Ack().encode(msg_id))  # nothing of it here
            return
        now = time.time()
        spent = self._retired.setdefault(token, {})
        for gid, expiry in list(spent.items()):  # past their expiry they are refused anyway
            if expiry < now:
                del spent[gid]
        for gid in message.grants:
            spent[gid] = now + grants.GRANT_TTL_S
        self.drop_grants(token, frozenset(message.grants))
        self._closing.setdefault(token, []).append((identity, msg_id, False))
        self._settle_closing()

    def _settle_closing(self) -> None:
        """Answers every close or retire whose session has nothing left in flight here
        (a closed session's buffers are unmapped then)."""
        if not self._closing:
            return
        busy = {p.session for p in self._pending.values()}
        for token in [t for t in self._closing if t not in busy]:
            waiting = self._closing.pop(token)
            if any(close for _, _, close in waiting):
                self.close_bell(token)
                for m in self._session_maps.pop(token, []):
                    m.close()
                self.sessions.pop(token, None)
            for identity, msg_id, _ in waiting:
                self.reply(identity, Ack().encode(msg_id))

    def check_grant(self, caller: Caller, kind: bytes, grant: bytes,
                    body: Callable[[], dict]) -> tuple[int, float]:
        """``(grant id, expiry)`` under which a client session may use what ``body()``
        returns (a plan's or a read's body; what the grant covers of it:
        :func:`tokenlake.dataplane.grants.payload`), or :class:`NotAuthorized`; the
        owner's session (and any session of a launcher that made no grant key) needs
        none, and its body is not even built: ``(-1, inf)``."""
        token = caller.require_session()
        if token == OWNER_SESSION or self.grant_key is None:
            return -1, float("inf")
        gid, expiry = grants.verify(self.grant_key, token, grant, kind, grants.payload(body()))
        if gid in self._retired.get(token, ()):
            raise NotAuthorized("this grant is spent (its iteration completed or aborted, or its "
                                "lease was finished)")
        return gid, expiry

    def drop_grants(self, token: bytes, grant_ids: frozenset[int]) -> None:
        """Forgets the plans of session ``token`` under these grants (subclasses)."""

    def session_buffers(self, caller: Caller) -> tuple[bytes, dict[str, torch.Tensor]]:
        """``(token, buffers)`` of the caller's session for a plan operation;
        ``NotAuthorized`` if it has none, ``PlanError`` if it is closing."""
        token = caller.require_session()
        if any(close for _, _, close in self._closing.get(token, ())):
            raise PlanError("this session is being closed")
        return token, self.sessions[token]

    def drop_session(self, token: bytes) -> None:
        """Forgets every plan of session ``token`` (subclasses; called on CLOSE_SESSION)."""

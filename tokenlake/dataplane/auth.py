"""ZeroMQ CURVE for a cluster: its keys, who may connect, and who sent a message.

Every socket of a cluster (the engines' ROUTERs, their peer DEALERs, the clients, the
control server) speaks CURVE unless the operator asked for ``insecure``: messages are
encrypted and every connection is authenticated (docs/security.md). A cluster has three
key pairs, generated when it starts (:meth:`ClusterKeys.generate`):

* the **server** pair: every engine's ROUTER and the control server prove it to whoever
  connects (the engines hold its secret half);
* the **owner** pair: the process that started the cluster, and only it, may send
  ``SHUTDOWN`` and ``PEERS`` (an engine that talks for the owner, the Ray relay, holds it);
* the **member** pair: data-plane clients and ``tokenlake.connect`` callers.

An engine connects to its peers with the server pair as its client keys: only an
engine holds that secret, so a peer request (``PEER_*``) is known to come from an
engine. A server accepts a connection only from the owner, member or server public key
(a ZAP handler, :class:`Gatekeeper`); it learns which one from each message
(:func:`sender`: ``"owner"``, ``"member"`` or ``"engine"``). Who holds what: the owner
all six halves; an engine the server pair, the member pair and the owner's public key; a
member the server's public key and the member pair (:meth:`ClusterKeys.engine_view`,
:meth:`ClusterKeys.member_view`). Members are told apart from each other by their
session (:mod:`tokenlake.dataplane.messages.session`), not by their keys.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from tokenlake.core.errors import ConfigError

log = logging.getLogger(__name__)

OWNER, MEMBER, ENGINE = "owner", "member", "engine"


@dataclass(frozen=True)
class ClusterKeys:
    """A cluster's CURVE keys, each as its 40-character Z85 text (``None``: not held)."""

    server_public: str
    member_public: str
    member_secret: str | None
    owner_public: str
    server_secret: str | None = None
    owner_secret: str | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is None and name.endswith("secret"):
                continue
            if not isinstance(value, str) or len(value) != 40:
                raise ConfigError(f"CURVE key {name} must be 40 characters of Z85 text")
            try:
                z85.decode(value)
            except Exception:
                raise ConfigError(f"CURVE key {name} is not Z85 text") from None

    @classmethod
    def generate(cls) -> ClusterKeys:
        """Fresh key pairs (libsodium's random generator, via ``zmq.curve_keypair``)."""
        (sp, ss), (mp, ms), (op, os_) = (zmq.curve_keypair() for _ in range(3))
        return cls(sp.decode(), mp.decode(), ms.decode(), op.decode(), ss.decode(), os_.decode())

    def engine_view(self, *, with_owner: bool = False) -> ClusterKeys:
        """What an engine holds: no owner secret, unless it relays the owner's requests."""
        return self if with_owner else replace(self, owner_secret=None)

    def member_view(self) -> ClusterKeys:
        """What a client holds: the server's public key and the member pair."""
        return replace(self, server_secret=None, owner_secret=None)

    def owner_client_view(self) -> ClusterKeys:
        """What the owner's own compute engines hold (its in-process clients, Ray's
        compute actors): the member view plus the owner pair, so that their clients use
        the instances' own buffers (the owner's session)."""
        return replace(self, server_secret=None)

    def to_dict(self) -> dict[str, str | None]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> ClusterKeys:
        if not isinstance(d, dict):
            raise ConfigError(f"CURVE keys must be a mapping, got {type(d).__name__}")
        known = {"server_public", "member_public", "member_secret", "owner_public",
                 "server_secret", "owner_secret"}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown CURVE key fields: {sorted(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"incomplete CURVE keys: {e}") from None


def serve_secure(sock: zmq.Socket, keys: ClusterKeys | None) -> None:
    """Makes ``sock`` (before it binds) a CURVE server with the cluster's server pair;
    nothing with ``keys=None`` (insecure)."""
    if keys is None:
        return
    if keys.server_secret is None:
        raise ConfigError("these CURVE keys have no server secret: only engines and the owner serve")
    sock.curve_secretkey = keys.server_secret.encode()
    sock.curve_publickey = keys.server_public.encode()
    sock.curve_server = True


def connect_secure(sock: zmq.Socket, keys: ClusterKeys | None, *, as_owner: bool = False,
                   as_engine: bool = False) -> None:
    """Makes ``sock`` (before it connects) a CURVE client of the cluster's servers, as
    the member or, with ``as_owner``, as the owner, or, with ``as_engine``, as an engine
    (the server pair: what an engine's peer requests are sent with); nothing with
    ``keys=None``."""
    if keys is None:
        return
    if as_engine:
        public, secret, who = keys.server_public, keys.server_secret, ENGINE
    elif as_owner:
        public, secret, who = keys.owner_public, keys.owner_secret, OWNER
    else:
        public, secret, who = keys.member_public, keys.member_secret, MEMBER
    if secret is None:
        raise ConfigError(f"these CURVE keys have no {who} secret")
    sock.curve_serverkey = keys.server_public.encode()
    sock.curve_publickey = public.encode()
    sock.curve_secretkey = secret.encode()


class Gatekeeper(ThreadAuthenticator):
    """The ZAP handler of one zmq context: it admits CURVE clients with the owner's, the
    member's or the server's (an engine's) public key, and names them ``"owner"``,
    ``"member"`` or ``"engine"`` in the ``User-Id`` of every message they send. Start it
    before the context's servers bind; :meth:`stop` it before terminating the context."""

    def __init__(self, ctx: zmq.Context, keys: ClusterKeys) -> None:
        super().__init__(ctx, log=logging.getLogger(__name__ + ".zap"))
        self._names = {keys.owner_public.encode(): OWNER, keys.member_public.encode(): MEMBER,
                       keys.server_public.encode(): ENGINE}
        self._refused = 0

    def start(self) -> None:
        super().start()
        self.configure_curve_callback("*", self)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self._names
        if not ok:
            self._refused += 1
            if self._refused in (1, 10, 100, 1000) or self._refused % 10000 == 0:
                log.warning("refused a CURVE connection with an unknown key (%d so far)", self._refused)
        return ok

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._names.get(z85.encode(client_public_key), "")


def guard(ctx: zmq.Context, keys: ClusterKeys | None) -> Gatekeeper | None:
    """Starts the :class:`Gatekeeper` of ``ctx`` (``None`` when insecure)."""
    if keys is None:
        return None
    gate = Gatekeeper(ctx, keys)
    gate.start()
    return gate


def sender(frame: zmq.Frame) -> str | None:
    """``"owner"``, ``"member"`` or ``"engine"``: who sent the message ``frame`` (a received frame, not
    the ROUTER's identity frame) belongs to; ``None`` on a socket without CURVE."""
    try:
        who = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    return who or None


"""The control server's table of client sessions: who is connected, what each holds,
and who has gone silent.

A session (docs/design.md §10) is one client process of a served pool: a
``tokenlake.connect`` caller, a vLLM connector worker. The table is bookkeeping only --
no sockets, no threads, the clock injected -- so its rules are unit-tested exactly:

* a session is named by its token (the routing id of its sockets) and numbered 1, 2,
  ... in opening order (0 is the serving process's own, which is not in the table);
  several connections may join one session (aliases of its token: the processes of
  one vLLM instance), and it ends when the last leaves or all go silent;
* it owns the iterations it planned (until completed or aborted), the requests it
  admitted (until finished) and the instances it has buffers on;
* it is **expired** when it has sent nothing for ``timeout_s`` seconds (its heartbeats
  stopped: the process died or hangs), or when one of its iterations has been in
  flight for ``iteration_timeout_s`` (a client that plans and never completes would
  otherwise hold segments others wait for);
* a client's request ids live in its own namespace: ``r`` of session ``n`` is
  ``"n/r"`` in the control plane (:meth:`SessionTable.internal`), so two clients may
  both name a request ``"r1"``.

Invariants (:meth:`SessionTable.check`): numbers and tokens are unique; every
iteration in flight belongs to one session; every internal request id of a session
starts with its number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tokenlake.core.errors import CapacityError, SessionEnded
from tokenlake.dataplane.messages.service import SessionInfo
from tokenlake.dataplane.messages.session import session_of

#: Seconds between a client's heartbeats (any request counts as one).
HEARTBEAT_S = 0.5
#: Seconds of silence after which the server ends a session.
SESSION_TIMEOUT_S = 3.0
#: Seconds an iteration of a client session may stay in flight.
ITERATION_TIMEOUT_S = 120.0
#: Sessions one server serves at once.
MAX_SESSIONS = 64


@dataclass
class Session:
    """One client session and what it holds (owned by :class:`SessionTable`)."""

    number: int
    token: bytes
    pid: int
    label: str
    opened_s: float
    seen_s: float
    connections: set[bytes] = field(default_factory=set)  # routing ids that opened or joined it
    iterations: dict[int, float] = field(default_factory=dict)  # in flight -> planned at
    requests: set[str] = field(default_factory=set)  # internal ids of its live requests
    leases: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # rid -> (read grant, instances)
    instances: set[int] = field(default_factory=set)  # where it has buffers

    @property
    def prefix(self) -> str:
        """What its request ids are prefixed with in the control plane."""
        return f"{self.number}/"


class SessionTable:
    """The open sessions of one server (see the module docstring).

    Args:
        clock: monotonic seconds (injected; ``time.monotonic`` in the server).
        timeout_s: silence that ends a session; iteration_timeout_s: the longest an
            iteration may stay in flight; max_sessions: how many may be open at once.
    """

    def __init__(self, clock: Callable[[], float], timeout_s: float = SESSION_TIMEOUT_S,
                 iteration_timeout_s: float = ITERATION_TIMEOUT_S,
                 max_sessions: int = MAX_SESSIONS) -> None:
        if timeout_s <= 0 or iteration_timeout_s <= 0 or max_sessions < 1:
            raise ValueError("session timeouts must be > 0 and max_sessions >= 1")
        self.clock, self.timeout_s = clock, timeout_s
        self.iteration_timeout_s, self.max_sessions = iteration_timeout_s, max_sessions
        self._by_token: dict[bytes, Session] = {}
        self._numbers = 0
        self.ended = 0  # sessions ended by the server (expired), for metrics and tests

    def __len__(self) -> int:
        return len(self._by_token)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_token.values()))

    # ------------------------------------------------------------ lifecycle
    def open(self, routing_id: bytes, pid: int, label: str) -> Session:
        """Opens the session of a connection's ``routing_id`` (its token or an alias of
        it), or joins it if it is open. Raises ``ValueError`` for a routing id that is no
        session's, ``CapacityError`` when ``max_sessions`` are open."""
        token = session_of(routing_id)
        if token is None:
            raise ValueError("a session is opened on a connection whose routing id is its token "
                             "(tokenlake.connect does this)")
        session = self._by_token.get(token)
        if session is None:
            if len(self._by_token) >= self.max_sessions:
                raise CapacityError(f"the pool serves {self.max_sessions} client sessions at most; "
                                    "close one first")
            self._numbers += 1
            now = self.clock()
            session = self._by_token[token] = Session(self._numbers, token, pid, label[:200], now, now)
        session.connections.add(routing_id)
        session.seen_s = self.clock()
        return session

    def leave(self, session: Session, routing_id: bytes) -> bool:
        """The connection ``routing_id`` leaves ``session``; True when it was the last
        (the caller ends the session)."""
        session.connections.discard(routing_id)
        return not session.connections

    def get(self, routing_id: bytes) -> Session:
        """The session of a connection's routing id, touched (it is alive). Raises
        :class:`~tokenlake.core.errors.SessionEnded` if it has none."""
        session = self.touch(routing_id)
        if session is None:
            raise SessionEnded("this client has no open session on the pool (never opened, "
                               "closed, or ended by the server after "
                               f"{self.timeout_s:g} s without a heartbeat)")
        return session

    def touch(self, routing_id: bytes) -> Session | None:
        """The session of a connection's routing id, touched, or None if it has none."""
        session = self.find(routing_id)
        if session is not None:
            session.seen_s = self.clock()
        return session

    def find(self, routing_id: bytes) -> Session | None:
        """The session of a connection's routing id (not touched), or None."""
        token = session_of(routing_id)
        return None if token is None else self._by_token.get(token)

    def remove(self, session: Session) -> None:
        self._by_token.pop(session.token, None)

    def expired(self) -> list[tuple[Session, str]]:
        """``(session, why)`` of every session to end now (silent, or an iteration
        overdue), oldest first."""
        now, out = self.clock(), []
        for s in self._by_token.values():
            if now - s.seen_s > self.timeout_s:
                out.append((s, f"no heartbeat for {now - s.seen_s:.1f} s"))
            elif s.iterations and now - min(s.iterations.values()) > self.iteration_timeout_s:
                out.append((s, f"an iteration in flight for more than {self.iteration_timeout_s:g} s"))
        return out

    # ------------------------------------------------------------ names
    @staticmethod
    def internal(session: Session, request_id: str) -> str:
        """The control plane's id of the session's request ``request_id``."""
        return session.prefix + request_id

    @staticmethod
    def external(session: Session, internal_id: str) -> str:
        """The session's own id of one of its requests (the inverse of :meth:`internal`)."""
        return internal_id[len(session.prefix):] if internal_id.startswith(session.prefix) else internal_id

    def owner_of(self, iteration: int) -> Session | None:
        """The session that has ``iteration`` in flight, or None."""
        for s in self._by_token.values():
            if iteration in s.iterations:
                return s
        return None

    # ------------------------------------------------------------ reading
    def infos(self) -> tuple[SessionInfo, ...]:
        """What ``tokenlake status`` lists, by session number."""
        now = self.clock()
        return tuple(SessionInfo(s.number, s.pid, s.label, now - s.opened_s, now - s.seen_s,
                                 len(s.iterations), len(s.requests), tuple(sorted(s.instances)))
                     for s in sorted(self._by_token.values(), key=lambda s: s.number))

    def check(self) -> None:
        """Asserts the invariants of the module docstring (tests)."""
        numbers = [s.number for s in self._by_token.values()]
        assert len(set(numbers)) == len(numbers), "session numbers repeat"
        seen: set[int] = set()
        for token, s in self._by_token.items():
            assert s.token == token and session_of(token) == token, "token out of place"
            assert all(session_of(c) == token for c in s.connections), "a connection of another session"
            assert not seen & s.iterations.keys(), "an iteration belongs to two sessions"
            seen |= s.iterations.keys()
            assert all(r.startswith(s.prefix) for r in s.requests), "request outside its namespace"

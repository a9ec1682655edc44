"""The driver's own sockets to a local cluster's engines: the owner's requests
(``PING``, ``PEERS``, ``COPY_SEGMENT``, the session kinds), on sockets kept open between
requests (a CURVE handshake per request cost milliseconds, and the control server
retires a client session's grants on every iteration it completes), sent to several
engines at once when asked."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import zmq

from tokenlake.core.errors import EngineUnavailable, TokenLakeError
from tokenlake.dataplane import wire
from tokenlake.dataplane.messages import WireMessage, expect, parse
from tokenlake.dataplane.sockets import send

Key = tuple[str, int]  # (role, instance)
Reply = TypeVar("Reply", bound=WireMessage)
Progress = Callable[[Key, WireMessage], None]


class DriverSockets:
    """One DEALER per engine, opened by ``dealer(key)`` on first use; one exchange at a
    time (a lock), every wait within ``timeout_s``.

    A socket whose request failed (no answer, a broken connection) is closed, so a late
    answer never meets the next request; :meth:`forget` closes an instance's sockets
    when its engines stop or move.

    ``dead(key)``, where the launcher can tell without a message that an engine's process
    has ended: such an engine is not waited for (``EngineUnavailable`` at once, or within
    ``poll_s`` of its death while it is awaited), so a dead engine costs a request
    nothing like ``timeout_s``; the control server, which retires a session's grants on
    the engines at every commit, would otherwise keep every other session waiting."""

    def __init__(self, dealer: Callable[[Key], zmq.Socket], timeout_s: float,
                 dead: Callable[[Key], bool] | None = None, poll_s: float = 0.05) -> None:
        self._dealer, self.timeout_s = dealer, timeout_s
        self.dead, self.poll_s = dead, poll_s
        self._socks: dict[Key, zmq.Socket] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False  # then every exchange fails at once (no socket is made again)

    def exchange(self, keys: list[Key], message: WireMessage | dict[Key, WireMessage],
                 reply: type[Reply], progress: Progress | None = None) -> dict[Key, Reply | BaseException]:
        """Sends ``message`` (or each key's own, a dict) to every engine of ``keys``, then
        reads each answer (within ``timeout_s`` in all); a key's value is its answer as
        a ``reply``, or its failure. With ``progress``, an engine may send progress
        messages (``TIER_PROGRESS``) under the request's id before its answer: each is
        handed to ``progress(key, message)`` as it comes, from every engine at once, and
        the engine then has ``timeout_s`` again (silence fails it, not a long read)."""
        out: dict[Key, Reply | BaseException] = {}
        with self._lock:
            if self._closed:
                return {key: EngineUnavailable("the driver's sockets are closed") for key in keys}
            sent = {}
            for key in keys:
                if self.dead is not None and self.dead(key):
                    out[key] = _gone(key)
                    continue
                try:
                    sock = self._socks.get(key)
                    if sock is None:
                        sock = self._socks[key] = self._dealer(key)
                    msg_id = next(self._ids)
                    one = message[key] if isinstance(message, dict) else message
                    send(sock, one.encode(msg_id), timeout_s=self.timeout_s)
                    sent[key] = (sock, msg_id)
                except Exception as exc:  # noqa: BLE001 - reported per key
                    out[key] = exc
                    self._drop(key)
            if progress is not None:
                out.update(self._streamed(sent, reply, progress))
                return out
            deadline = time.monotonic() + self.timeout_s
            for key, (sock, msg_id) in sent.items():
                try:
                    while True:
                        self._await(key, sock, deadline)
                        answer = wire.recv(sock, max(0.0, deadline - time.monotonic()))
                        if answer.msg_id == msg_id:
                            out[key] = expect(answer, reply)
                            break
                except Exception as exc:  # noqa: BLE001 - reported per key
                    out[key] = exc
                    if not isinstance(exc, TokenLakeError) or isinstance(exc, EngineUnavailable):
                        self._drop(key)
        return out

    def _await(self, key: Key, sock: zmq.Socket, deadline: float) -> None:
        """Returns once ``sock`` has a message; raises ``EngineUnavailable`` when
        ``deadline`` passes or as soon as the engine has ended (:meth:`_ended`)."""
        if self.dead is None:
            return
        while not sock.poll(max(0.0, min(self.poll_s, deadline - time.monotonic())) * 1000):
            if self._ended(key, sock):
                raise _gone(key)
            if time.monotonic() >= deadline:
                raise EngineUnavailable(f"{key[0]} engine {key[1]}: no answer within {self.timeout_s:g} s")

    def _ended(self, key: Key, sock: zmq.Socket) -> bool:
        """Whether ``dead`` says so and nothing ``key`` sent before its end is left unread."""
        return self.dead is not None and self.dead(key) and not sock.poll(0)

    def _streamed(self, sent: dict[Key, tuple[zmq.Socket, int]], reply: type[Reply],
                  progress: Progress) -> dict[Key, Reply | BaseException]:
        """The answers of :meth:`exchange` with ``progress``: every socket polled at
        once, each with a deadline of its own, moved on by each progress message."""
        out: dict[Key, Reply | BaseException] = {}
        poller = zmq.Poller()
        by_sock = {sock: key for key, (sock, _) in sent.items()}
        for sock in by_sock:
            poller.register(sock, zmq.POLLIN)
        due = dict.fromkeys(sent, time.monotonic() + self.timeout_s)
        while due:
            wait_s = max(0.0, min(due.values()) - time.monotonic())
            if self.dead is not None:
                wait_s = min(wait_s, self.poll_s)
            for sock, _ in poller.poll(wait_s * 1000):
                key, drop = by_sock[sock], False
                try:
                    answer = wire.recv(sock, 0.0)
                    if answer.msg_id != sent[key][1]:
                        continue  # a late answer to an earlier request
                    if answer.kind == wire.Kind.TIER_PROGRESS:
                        progress(key, parse(answer))
                        due[key] = time.monotonic() + self.timeout_s
                        continue
                    out[key] = expect(answer, reply)
                except Exception as exc:  # noqa: BLE001 - reported per key
                    out[key] = exc
                    drop = not isinstance(exc, TokenLakeError) or isinstance(exc, EngineUnavailable)
                poller.unregister(sock)
                del due[key]
                if drop:
                    self._drop(key)
            now = time.monotonic()
            for key in [k for k, t in due.items() if t <= now or self._ended(k, sent[k][0])]:
                out[key] = _gone(key) if due[key] > now else EngineUnavailable(
                    f"{key[0]} engine {key[1]}: neither an answer nor progress within {self.timeout_s:g} s")
                poller.unregister(sent[key][0])
                del due[key]
                self._drop(key)
        return out

    def forget(self, instance: int) -> None:
        """Closes the sockets to ``instance``'s engines (they stop, or start again at
        new addresses)."""
        with self._lock:
            for key in [k for k in self._socks if k[1] == instance]:
                self._drop(key)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for key in list(self._socks):
                self._drop(key)

    def _drop(self, key: Key) -> None:
        sock = self._socks.pop(key, None)
        if sock is not None:
            sock.close(0)


def ended_in(procs: Mapping[Key, Any]) -> Callable[[Key], bool]:
    """``dead`` for engines run as processes of this one, ``procs[key]`` (with
    ``is_alive()``): true once the process has ended. A key not there, or a process that
    can no longer be asked (closed while replaced), counts as running: its request waits
    as it did before."""
    def dead(key: Key) -> bool:
        proc = procs.get(key)
        try:
            return proc is not None and not proc.is_alive()
        except (ValueError, OSError):
            return False
    return dead


def _gone(key: Key) -> EngineUnavailable:
    return EngineUnavailable(f"the {key[0]} engine of instance {key[1]} is not running")

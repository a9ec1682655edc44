"""The transport under the wire format: multipart zmq messages on sockets, with a
timeout on every wait, and the default bind address.

Nothing here reads a message: :func:`recv_frames` hands raw frames to
:func:`tokenlake.dataplane.wire.decode` (``wire.recv`` does both). A peer that does not
answer, or a socket that fails, raises :class:`~tokenlake.core.errors.EngineUnavailable`.
"""

from __future__ import annotations

import ipaddress
import logging
import math
from collections.abc import Sequence

import zmq

from tokenlake.core.errors import EngineUnavailable

log = logging.getLogger(__name__)

#: Frames at least this large go without copying; smaller ones are copied into the
#: zmq message. A zero-copy frame costs pyzmq a buffer-lifetime hand-off to its garbage
#: collector thread (measured ~0.8 ms per message on a 2-core VM), far more than
#: copying a header or a few KiB.
ZERO_COPY_MIN_BYTES = 64 * 1024


def send_frames(sock: zmq.Socket, frames: Sequence, flags: int = 0) -> None:
    """Sends one multipart message: large frames zero-copy, small ones copied (the
    copy of a small frame is zmq's, not counted in
    :class:`~tokenlake.dataplane.tensor_frames.CopyStats`)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        nbytes = frame.nbytes if isinstance(frame, memoryview) else len(frame)
        more = zmq.SNDMORE if i < last else 0
        sock.send(frame, flags | more, copy=nbytes < ZERO_COPY_MIN_BYTES)


def send(sock: zmq.Socket, frames: list, *, timeout_s: float | None = None) -> None:
    """Send one message's frames (see :func:`send_frames`).

    With ``timeout_s``, wait at most that long for room to send; a full or peerless
    socket then raises :class:`~tokenlake.core.errors.EngineUnavailable` instead of blocking.
    """
    try:
        if timeout_s is not None:
            if not sock.poll(_timeout_ms(timeout_s), zmq.POLLOUT):
                raise EngineUnavailable(
                    f"cannot send to {_peer(sock)}: no room within {timeout_s:g} s"
                )
            send_frames(sock, frames, zmq.NOBLOCK)
        else:
            send_frames(sock, frames)
    except zmq.ZMQError as e:
        raise EngineUnavailable(f"cannot send to {_peer(sock)}: {e}") from e


def send_routed(
    sock: zmq.Socket, envelope: Sequence | bytes, frames: list, *, timeout_s: float | None = None
) -> None:
    """Send ``frames`` on a ROUTER socket to the peer named by ``envelope`` (what
    :func:`tokenlake.dataplane.wire.recv_routed` returned)."""
    head = [envelope] if isinstance(envelope, (bytes, zmq.Frame)) else list(envelope)
    send(sock, [*head, *frames], timeout_s=timeout_s)


def recv_frames(sock: zmq.Socket, timeout_s: float, peer: str | None = None) -> list:
    """The frames of one multipart message (zero-copy ``zmq.Frame``\\ s), waiting at most
    ``timeout_s`` seconds.

    Raises:
        EngineUnavailable: nothing arrived in time (or the socket failed); the message
            names ``peer`` (default: the socket's last endpoint) and the timeout.
        ValueError: ``timeout_s`` is not a finite number >= 0.
    """
    ms = _timeout_ms(timeout_s)
    try:
        if sock.poll(ms, zmq.POLLIN):
            return sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        pass
    except zmq.ZMQError as e:
        raise EngineUnavailable(f"receiving from {peer or _peer(sock)} failed: {e}") from e
    raise EngineUnavailable(f"no message from {peer or _peer(sock)} within {timeout_s:g} s")


def bind_address(host: str = "127.0.0.1", port: int | None = None, *, secure: bool = False) -> str:
    """A zmq TCP endpoint to bind: ``tcp://127.0.0.1:*`` (any free port) by default.

    Loopback is the default (docs/design.md §4); other hosts only when configured. A
    non-loopback host without CURVE (``secure=False``) is logged as a warning.
    Find the port actually bound with ``sock.getsockopt_string(zmq.LAST_ENDPOINT)``.
    """
    if not isinstance(host, str) or not host or any(c.isspace() or c in "/" for c in host):
        raise ValueError(f"host must be a hostname or IP address, got {host!r}")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535
    ):
        raise ValueError(f"port must be in [1, 65535] or None (any free port), got {port!r}")
    if not secure and not is_loopback(host):
        log.warning(
            "binding %s without CURVE (insecure): trusted networks only", host
        )
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal (the socket also needs zmq.IPV6 set)
    return f"tcp://{host}:{'*' if port is None else port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _timeout_ms(timeout_s: float) -> int:
    if not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a finite number >= 0 (seconds), got {timeout_s!r}")
    return math.ceil(timeout_s * 1000)


def _peer(sock: zmq.Socket) -> str:
    try:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT) or "peer"
    except zmq.ZMQError:
        return "peer (socket closed)"

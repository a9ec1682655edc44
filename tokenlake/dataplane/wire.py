"""The data plane's wire format: typed msgpack headers plus zero-copy tensor frames.

A message is one multipart zmq message (``docs/protocol.md`` is the full spec)::

    frame 0      msgpack map {"v": version, "k": kind, "id": msg_id, "b": body,
                              "t": [[dtype, [shape...]], ...]}      (at most 1 MiB)
    frame 1..n   the raw bytes of tensor i-1: C order, little-endian, no padding

Nothing on a socket is ever pickled; the header holds msgpack-native values only.

Three layers, lowest first: :mod:`tokenlake.dataplane.tensor_frames` (dtype allowlist,
zero-copy tensor frames, :class:`WireError`, :class:`CopyStats`) and
:mod:`tokenlake.dataplane.sockets` (zmq transport, timeouts); this module (protocol
version, kinds, the header, :func:`encode`/:func:`decode` of a generic
:class:`Message`, errors across the wire); :mod:`tokenlake.dataplane.messages` (one
frozen dataclass per kind that validates its own body).

Failure: a malformed message raises :class:`WireError` (never another exception type),
a peer that does not answer within the timeout raises
:class:`~tokenlake.core.errors.EngineUnavailable`, and an ``ERROR`` reply becomes a typed
exception at the caller through :func:`raise_if_error`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from tokenlake.core import errors
from tokenlake.core.errors import TokenLakeError
from tokenlake.dataplane.sockets import recv_frames
from tokenlake.dataplane.tensor_frames import (
    CopyStats,
    TensorMeta,
    WireError,
    as_bytes_view,
    frame_to_tensor,
    short,
    tensor_to_frame,
)

__all__ = [
    "PROTOCOL_VERSION", "Kind", "Message", "RemoteError", "WireError", "decode", "encode",
    "error_message", "raise_if_error", "recv", "recv_routed",
]

#: 2: peer traffic got its own kinds and every body a fixed schema (docs/protocol.md).
PROTOCOL_VERSION = 4
MAX_HEADER_BYTES = 1 << 20  # a header frame larger than 1 MiB is refused
MAX_BODY_DEPTH = 32  # deepest nesting of lists/maps in a body
MAX_ERROR_TEXT = 64 * 1024  # an ERROR's message is cut to this many characters
_HEADER_KEYS = frozenset({"v", "k", "id", "b", "t"})
_MAX_MSG_ID = (1 << 64) - 1


class Kind(enum.IntEnum):
    """Message kinds, grouped by tens: 0x every engine, 1x a query engine's clients,
    2x a transfer engine's clients, 3x the driver, 4x query engine to query engine, 5x
    transfer engine to transfer engine, 6x a control-plane server's clients, 7x that
    server's answers, 8x a client's session with that server.
    :mod:`tokenlake.dataplane.messages` has the body of each."""

    PING = 1
    PONG = 2
    ERROR = 3
    ACK = 4
    RELEASE_PLAN = 5
    PLAN_ACK = 6
    REGISTER_QUERY_PLAN = 10
    QUERY = 11
    QUERY_DONE = 12
    REGISTER_TRANSFER_PLAN = 20
    PUT = 21
    PUT_DONE = 22
    COPY_SEGMENT = 23
    COPY_DONE = 24
    READ_SEGMENT = 25
    SEGMENT_DATA = 26
    TIER_OPS = 27
    TIER_READ = 28
    TIER_DONE = 29
    SHUTDOWN = 30
    PEERS = 31
    OPEN_SESSION = 32
    CLOSE_SESSION = 33
    RETIRE = 34
    ADOPT = 35
    TIER_LIST = 36
    TIER_LISTING = 37
    TIER_PROGRESS = 38
    PEER_REGISTER_PLAN = 40
    PEER_RELEASE_PLAN = 41
    PEER_QUERY = 42
    PEER_QUERY_RESULT = 43
    PEER_PUT = 50
    PEER_SEGMENT = 51
    CP_MATCH = 60
    CP_CACHE_LOAD = 61
    CP_GEN_PLANS = 62
    CP_COMPLETE = 63
    CP_ABORT = 64
    CP_FINISH_REQUEST = 65
    CP_STATS = 66
    CP_CLIENT_INFO = 67
    CP_LEASE_PREFIX = 68
    CP_MATCHED = 70
    CP_LOAD = 71
    CP_PLANS = 72
    CP_STATS_RESULT = 76
    CP_CLIENT_INFO_RESULT = 77
    CP_LEASED = 78
    CP_OPEN_SESSION = 80
    CP_SESSION = 81
    CP_HEARTBEAT = 82
    CP_CLOSE_SESSION = 83


class RemoteError(TokenLakeError):
    """A peer answered ``ERROR`` with an exception type that has no local counterpart."""

    def __init__(self, remote_type: str, message: str) -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.remote_message = message


@dataclass(frozen=True)
class Message:
    """A decoded message: its kind, id, msgpack-native body and CPU torch tensors (see
    :mod:`tokenlake.dataplane.tensor_frames` on copies). The body is checked to be
    msgpack-native only; :func:`tokenlake.dataplane.messages.parse` reads it into the
    kind's typed message."""

    kind: Kind
    msg_id: int
    body: dict = field(default_factory=dict)
    tensors: tuple = ()


# ---------------------------------------------------------------- encode / decode


def encode(kind: Kind | int, msg_id: int, body: dict | None = None, tensors: Sequence = ()) -> list:
    """Frames of one message: ``[header bytes, *tensor memoryviews]``, copying no tensor.

    ``tensors`` are C-contiguous CPU torch tensors or numpy arrays of an allowlisted
    dtype; the returned buffers alias their storage (and keep it alive).

    Raises:
        WireError: unknown kind, bad id, a body value that is not msgpack-native or a
            non-str key, a tensor that is non-contiguous, not on the CPU, or of another
            dtype, or a header over 1 MiB.
    """
    kind = _check_kind(kind)
    if not isinstance(msg_id, int) or isinstance(msg_id, bool) or not 0 <= msg_id <= _MAX_MSG_ID:
        raise WireError(f"msg_id must be an int in [0, 2**64), got {short(msg_id)}")
    body = {} if body is None else body
    _check_body(body)
    if isinstance(tensors, (torch.Tensor, np.ndarray)):
        raise WireError("tensors must be a sequence of tensors; wrap a single tensor in a list")
    metas, buffers = [], []
    for i, t in enumerate(tensors):
        meta, buf = tensor_to_frame(i, t)
        metas.append(meta.to_wire())
        buffers.append(buf)
    header = {"v": PROTOCOL_VERSION, "k": int(kind), "id": msg_id, "b": body, "t": metas}
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # checked above; belt and braces
        raise WireError(f"cannot pack the header: {e}") from e
    if len(packed) > MAX_HEADER_BYTES:
        raise WireError(f"header is {len(packed)} bytes (at most {MAX_HEADER_BYTES})")
    return [packed, *buffers]


def decode(frames: Sequence) -> Message:
    """Parse and validate one message (frames: bytes, bytearray, memoryview or zmq.Frame).

    Raises:
        WireError: on anything malformed, with a message that says what; never another
            exception type.
    """
    if isinstance(frames, (bytes, bytearray, memoryview, str)) or not isinstance(frames, Sequence):
        raise WireError(f"frames must be a list of buffers, got {type(frames).__name__}")
    if not frames:
        raise WireError("message has no frames")
    views = [as_bytes_view(i, f) for i, f in enumerate(frames)]
    header = _parse_header(views[0])
    try:
        return _build_message(header, views[1:])
    except WireError as e:
        e.msg_id = header["id"]
        raise


def _parse_header(view: memoryview) -> dict:
    if len(view) == 0:
        raise WireError("header frame is empty")
    if len(view) > MAX_HEADER_BYTES:
        raise WireError(f"header frame is {len(view)} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = msgpack.unpackb(
            view, raw=False, strict_map_key=False, use_list=True, ext_hook=_refuse_ext
        )
    except Exception as e:  # msgpack raises ValueError, TypeError, UnicodeDecodeError, ...
        raise WireError(f"header is not valid msgpack: {type(e).__name__}: {e}") from e
    if not isinstance(header, dict):
        raise WireError(f"header is a msgpack {type(header).__name__}, not a map")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise WireError(
            f"unsupported protocol version {short(version)} (this peer speaks {PROTOCOL_VERSION})"
        )
    keys = set(header)
    if keys != _HEADER_KEYS:
        missing, extra = sorted(_HEADER_KEYS - keys), sorted(map(repr, keys - _HEADER_KEYS))
        raise WireError(f"header keys: missing {missing}, unexpected {short(extra)}")
    msg_id = header["id"]
    if not isinstance(msg_id, int) or isinstance(msg_id, bool) or not 0 <= msg_id <= _MAX_MSG_ID:
        raise WireError(f"header id {short(msg_id)} is not an int in [0, 2**64)")
    return header


def _refuse_ext(code: int, data: bytes) -> None:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def _build_message(header: dict, tensor_frames: list[memoryview]) -> Message:
    kind = _check_kind(header["k"])
    body = header["b"]
    if not isinstance(body, dict):
        raise WireError(f"body is a {type(body).__name__}, not a map")
    _check_body(body)
    entries = header["t"]
    if not isinstance(entries, list):
        raise WireError(f"header 't' is a {type(entries).__name__}, not a list")
    if len(entries) != len(tensor_frames):
        raise WireError(
            f"header declares {len(entries)} tensors but {len(tensor_frames)} tensor frames "
            "were received"
        )
    tensors, copied = [], 0
    for i, (entry, view) in enumerate(zip(entries, tensor_frames)):
        try:
            meta = TensorMeta.from_wire(entry)
        except WireError as e:
            raise WireError(f"tensor {i}: {e}") from None
        if meta.nbytes != len(view):
            raise WireError(
                f"tensor {i} ({meta.dtype} {list(meta.shape)}) needs {meta.nbytes} bytes "
                f"but its frame has {len(view)}"
            )
        tensor, n = frame_to_tensor(meta, view)
        tensors.append(tensor)
        copied += n
    if copied:
        CopyStats.record(copied)
    return Message(kind, header["id"], body, tuple(tensors))


def _check_kind(kind: Any) -> Kind:
    if isinstance(kind, bool) or not isinstance(kind, int):
        raise WireError(f"message kind {short(kind)} is not an int")
    try:
        return Kind(kind)
    except ValueError:
        raise WireError(f"unknown message kind {kind}") from None


def _check_body(body: Any) -> None:
    if not isinstance(body, dict):
        raise WireError(f"body must be a dict, got {type(body).__name__}")
    _check_value(body, "body", 0)


def _check_value(value: Any, path: str, depth: int) -> None:
    """Accept exactly msgpack-native values: None/bool/int/float/str/bytes, lists, str-keyed maps."""
    if value is None or isinstance(value, (bool, float, str, bytes)):
        return
    if isinstance(value, int):
        if not -(1 << 63) <= value <= _MAX_MSG_ID:
            raise WireError(f"{path}: integer {short(value)} does not fit in 64 bits")
        return
    if depth >= MAX_BODY_DEPTH:
        raise WireError(f"{path}: nested deeper than {MAX_BODY_DEPTH} levels")
    if isinstance(value, list) or type(value) is tuple:  # a tuple travels as a list
        for i, v in enumerate(value):
            _check_value(v, f"{path}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise WireError(f"{path}: key {short(k)} is a {type(k).__name__}, not a str")
            _check_value(v, f"{path}[{short(k)}]", depth + 1)
    else:
        raise WireError(
            f"{path}: {type(value).__module__}.{type(value).__qualname__} is not a "
            "msgpack-native value (None, bool, int, float, str, bytes, list, str-keyed dict)"
        )


# ---------------------------------------------------------------- receiving


def recv(sock: zmq.Socket, timeout_s: float, *, peer: str | None = None) -> Message:
    """Receive and decode one message, waiting at most ``timeout_s`` seconds.

    Raises:
        EngineUnavailable: nothing arrived in time (or the socket failed); the message
            names ``peer`` (default: the socket's last endpoint) and the timeout.
        WireError: the message is malformed.
    """
    return decode(recv_frames(sock, timeout_s, peer))


def recv_routed(
    sock: zmq.Socket, timeout_s: float, *, peer: str | None = None
) -> tuple[tuple, Message]:
    """On a ROUTER socket: ``(envelope, message)``; answer with
    :func:`tokenlake.dataplane.sockets.send_routed`.

    The envelope is the peer's identity frame, plus the empty delimiter frame when the
    peer is a REQ socket. Peers connect directly (no proxies in between). A malformed
    message raises :class:`WireError` with ``envelope`` (and ``msg_id`` when known) set,
    so the server can reply ``ERROR`` and keep serving.
    """
    frames = recv_frames(sock, timeout_s, peer)
    cut = 2 if len(frames) > 1 and len(frames[1]) == 0 else 1
    envelope = tuple(frames[:cut])
    try:
        if len(frames) <= cut:
            raise WireError("routed message has an envelope but no header frame")
        return envelope, decode(frames[cut:])
    except WireError as e:
        e.envelope = envelope
        raise


# ---------------------------------------------------------------- errors across the wire


#: Most request ids an ``ERROR`` names (``SegmentInFlight``: the requests that must wait).
MAX_ERROR_REQUEST_IDS = 4096


def error_message(msg_id: int, exc: BaseException) -> list:
    """``ERROR`` frames answering ``msg_id`` with ``{"type": class name, "message": str}``
    and, for an error that names requests (``SegmentInFlight.request_ids``,
    ``PrefixNotCached.request_ids``),
    ``"request_ids": [str]``.

    A :class:`RemoteError` being passed on keeps the type name of its origin.
    """
    if isinstance(exc, RemoteError):
        kind, text = exc.remote_type, exc.remote_message
    else:
        kind, text = type(exc).__name__, str(exc)
    if len(text) > MAX_ERROR_TEXT:
        text = text[:MAX_ERROR_TEXT] + "... (truncated)"
    body: dict[str, Any] = {"type": kind, "message": text}
    rids = getattr(exc, "request_ids", None)
    if rids:
        body["request_ids"] = [str(r) for r in rids[:MAX_ERROR_REQUEST_IDS]]
    return encode(Kind.ERROR, msg_id, body)


def raise_if_error(msg: Message) -> Message:
    """Return ``msg`` unless it is an ``ERROR``; then raise the matching typed exception.

    Type names of :mod:`tokenlake.core.errors` (and ``WireError``) map to those classes;
    any other name raises :class:`RemoteError` carrying it (no other class is ever
    instantiated from a name that came over the wire).
    """
    if msg.kind != Kind.ERROR:
        return msg
    raise remote_exception(msg.body.get("type"), msg.body.get("message"), msg.body.get("request_ids"))


def remote_exception(name: Any, text: Any, request_ids: Any = None) -> TokenLakeError:
    """The exception an ``ERROR`` body ``{"type": name, "message": text}`` stands for
    (with ``request_ids``, when the body names requests and the class takes them).

    Raises:
        WireError: ``name`` or ``text`` is not a str, or ``request_ids`` not a list of str.
    """
    if not isinstance(name, str) or not isinstance(text, str):
        raise WireError(f"ERROR body {short({'type': name, 'message': text})} lacks str 'type' and 'message'")
    if request_ids is not None and not (isinstance(request_ids, list)
                                        and all(isinstance(r, str) for r in request_ids)):
        raise WireError(f"ERROR body's request_ids must be a list of str, got {short(request_ids)}")
    cls = _known_errors().get(name)
    try:
        if cls is not None and request_ids is not None and cls in (errors.SegmentInFlight,
                                                                    errors.PrefixNotCached):
            return cls(text, tuple(request_ids))
        return RemoteError(name, text) if cls is None else cls(text)
    except Exception:  # a known class whose constructor wants more than a message
        return RemoteError(name, text)


def _known_errors() -> dict[str, type[TokenLakeError]]:
    known = {
        name: obj
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, TokenLakeError)
    }
    known[WireError.__name__] = WireError
    return known

"""The data plane's wire format: typed msgpack headers plus zero-copy tensor frames.

A message is one multipart zmq message (``docs/protocol.md`` is the full spec)::

    frame 0      msgpack map {"v": version, "k": kind, "id": msg_id, "b": body,
                              "t": [[dtype, [shape...]], ...]}      (at most 1 MiB)
    frame 1..n   the raw bytes of tensor i-1: C order, little-endian, no padding

Nothing on a socket is ever pickled; the header holds msgpack-native values only.

Copies (counted in :class:`CopyStats`):

* :func:`encode` never copies tensor bytes. Its buffer frames are ``memoryview``\\ s of
  the tensors' own storage; a non-contiguous tensor is refused (:class:`WireError`)
  rather than silently made contiguous. Do not write to a tensor until its message has
  left (for a request: until the reply arrived).
* :func:`decode` wraps each tensor frame with ``torch.frombuffer`` (zero copy) when the
  buffer is writable and aligned to the dtype's item size; the tensor then aliases the
  frame (pyzmq >= 23 hands out writable frame buffers). It copies a frame into fresh
  memory when the buffer is read-only (``bytes``, a ``recv_multipart(copy=True)``
  result): a tensor over immutable memory would make any in-place op undefined
  behaviour, and ``torch.frombuffer`` warns about exactly that. It also copies when the
  address is misaligned (libzmq's TCP decoder may place small messages at odd offsets).

Failure: a malformed message raises :class:`WireError` (never another exception type),
a peer that does not answer within the timeout raises
:class:`~tokenlake.core.errors.EngineUnavailable`, and an ``ERROR`` reply becomes a typed
exception at the caller through :func:`raise_if_error`.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from tokenlake.core import errors
from tokenlake.core.errors import EngineUnavailable, TokenLakeError

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20  # a header frame larger than 1 MiB is refused
MAX_NDIM = 16  # most dimensions a tensor may declare
MAX_BODY_DEPTH = 32  # deepest nesting of lists/maps in a body
MAX_ERROR_TEXT = 64 * 1024  # an ERROR's message is cut to this many characters
_HEADER_KEYS = frozenset({"v", "k", "id", "b", "t"})
_MAX_MSG_ID = (1 << 64) - 1

# The dtype allowlist: wire name -> torch dtype. The wire name is numpy's name where
# numpy has the dtype; bfloat16 travels as its raw 2-byte patterns.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
_TORCH_NAMES = {dt: name for name, dt in DTYPES.items()}


class Kind(enum.IntEnum):
    """Message kinds. Numbers are grouped by tens so that each group has room to grow."""

    PING = 1
    PONG = 2
    ERROR = 3
    REGISTER_PLAN = 10
    RELEASE_PLAN = 11
    QUERY = 12
    QUERY_RESULT = 13
    PUT = 20
    PUT_DONE = 21
    COPY_SEGMENT = 22
    COPY_DONE = 23
    READ_SEGMENT = 24
    SEGMENT_DATA = 25
    SHUTDOWN = 30
    PEERS = 31


class WireError(TokenLakeError):
    """A message is malformed (or cannot be encoded).

    Raised for bad msgpack, another protocol version, an unknown kind, a frame count or
    frame size that does not match the header, a dtype off the allowlist, a bad shape,
    a body that is not msgpack-native, or a non-contiguous tensor to send.

    ``msg_id`` is the message's id when the header was readable far enough to tell, so a
    server can answer with an ``ERROR`` carrying it; ``envelope`` is set by
    :func:`recv_routed` so the server knows whom to answer.
    """

    msg_id: int | None = None
    envelope: tuple[bytes, ...] | None = None


class RemoteError(TokenLakeError):
    """A peer answered ``ERROR`` with an exception type that has no local counterpart."""

    def __init__(self, remote_type: str, message: str) -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.remote_message = message


class CopyStats:
    """Process-wide count of tensor bytes that wire.py copied (tests assert zeros).

    ``bytes_copied`` is the sum of copied payload bytes; ``messages`` counts the
    messages during whose encode/decode at least one byte was copied. Header packing is
    serialisation, not a copy, and is not counted; neither are copies made by pyzmq
    itself (it copies frames below ``zmq.COPY_THRESHOLD``, 64 KiB, even with
    ``copy=False``).
    """

    bytes_copied: int = 0
    messages: int = 0
    _lock = threading.Lock()

    @classmethod
    def reset(cls) -> None:
        with cls._lock:
            cls.bytes_copied = 0
            cls.messages = 0

    @classmethod
    def _record(cls, nbytes: int) -> None:
        with cls._lock:
            cls.bytes_copied += nbytes
            cls.messages += 1


@dataclass(frozen=True)
class TensorMeta:
    """What the header says about one tensor frame: allowlisted dtype and C-order shape."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise WireError(f"dtype {_short(self.dtype)} is not one of {sorted(DTYPES)}")
        if len(self.shape) > MAX_NDIM:
            raise WireError(f"shape has {len(self.shape)} dimensions (at most {MAX_NDIM})")
        for d in self.shape:
            if not isinstance(d, int) or isinstance(d, bool):
                raise WireError(f"shape {_short(self.shape)} has a non-integer dimension")
            if d < 0:
                raise WireError(f"shape {list(self.shape)} has a negative dimension")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def to_wire(self) -> list:
        return [self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, entry: Any) -> TensorMeta:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list)):
            raise WireError(f"tensor entry {_short(entry)} is not [dtype, [shape...]]")
        return cls(entry[0], tuple(entry[1]))


@dataclass(frozen=True)
class Message:
    """A decoded message. ``tensors`` are CPU torch tensors (see the module doc on copies)."""

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
        raise WireError(f"msg_id must be an int in [0, 2**64), got {_short(msg_id)}")
    body = {} if body is None else body
    _check_body(body)
    if isinstance(tensors, (torch.Tensor, np.ndarray)):
        raise WireError("tensors must be a sequence of tensors; wrap a single tensor in a list")
    metas, buffers = [], []
    for i, t in enumerate(tensors):
        meta, buf = _tensor_frame(i, t)
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
    views = [_as_bytes_view(i, f) for i, f in enumerate(frames)]
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
            f"unsupported protocol version {_short(version)} (this peer speaks {PROTOCOL_VERSION})"
        )
    keys = set(header)
    if keys != _HEADER_KEYS:
        missing, extra = sorted(_HEADER_KEYS - keys), sorted(map(repr, keys - _HEADER_KEYS))
        raise WireError(f"header keys: missing {missing}, unexpected {_short(extra)}")
    msg_id = header["id"]
    if not isinstance(msg_id, int) or isinstance(msg_id, bool) or not 0 <= msg_id <= _MAX_MSG_ID:
        raise WireError(f"header id {_short(msg_id)} is not an int in [0, 2**64)")
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
        tensor, n = _frame_tensor(meta, view)
        tensors.append(tensor)
        copied += n
    if copied:
        CopyStats._record(copied)
    return Message(kind, header["id"], body, tuple(tensors))


def _check_kind(kind: Any) -> Kind:
    if isinstance(kind, bool) or not isinstance(kind, int):
        raise WireError(f"message kind {_short(kind)} is not an int")
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
            raise WireError(f"{path}: integer {_short(value)} does not fit in 64 bits")
        return
    if depth >= MAX_BODY_DEPTH:
        raise WireError(f"{path}: nested deeper than {MAX_BODY_DEPTH} levels")
    if isinstance(value, list) or type(value) is tuple:  # a tuple travels as a list
        for i, v in enumerate(value):
            _check_value(v, f"{path}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise WireError(f"{path}: key {_short(k)} is a {type(k).__name__}, not a str")
            _check_value(v, f"{path}[{_short(k)}]", depth + 1)
    else:
        raise WireError(
            f"{path}: {type(value).__module__}.{type(value).__qualname__} is not a "
            "msgpack-native value (None, bool, int, float, str, bytes, list, str-keyed dict)"
        )


def _tensor_frame(i: int, t: Any) -> tuple[TensorMeta, memoryview]:
    """The tensor's meta and a flat uint8 memoryview of its own storage (no copy)."""
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise WireError(f"tensor {i} is a {t.layout} tensor on {t.device}; only dense CPU")
        name = _TORCH_NAMES.get(t.dtype)
        if name is None:
            raise WireError(f"tensor {i} has dtype {t.dtype}, not one of {sorted(DTYPES)}")
        if not t.is_contiguous():
            raise WireError(
                f"tensor {i} is not contiguous (shape {list(t.shape)}, stride {list(t.stride())}); "
                "encode never copies: call .contiguous() first if a copy is what you want"
            )
        try:  # all views: flatten (contiguous), reinterpret as bytes, share with numpy
            flat = t.detach().reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError) as e:
            raise WireError(f"tensor {i} cannot be exposed as bytes: {e}") from e
        return TensorMeta(name, tuple(t.shape)), memoryview(flat)
    if isinstance(t, np.ndarray):
        name = t.dtype.name
        if name not in DTYPES or t.dtype.itemsize != DTYPES[name].itemsize:
            raise WireError(f"array {i} has dtype {t.dtype}, not one of {sorted(DTYPES)}")
        if not t.dtype.isnative:
            raise WireError(f"array {i} has non-native byte order {t.dtype.str}")
        if not t.flags.c_contiguous:
            raise WireError(
                f"array {i} is not C-contiguous (strides {t.strides}); encode never copies: "
                "call np.ascontiguousarray first if a copy is what you want"
            )
        return TensorMeta(name, tuple(t.shape)), memoryview(t.reshape(-1).view(np.uint8))
    raise WireError(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor or numpy.ndarray")


def _frame_tensor(meta: TensorMeta, view: memoryview) -> tuple[torch.Tensor, int]:
    """The tensor over ``view`` and how many bytes had to be copied to build it."""
    dtype = DTYPES[meta.dtype]
    if meta.nbytes == 0:
        return torch.empty(meta.shape, dtype=dtype), 0
    copied = 0
    if view.readonly:
        flat, copied = _copy_bytes(view), len(view)
    else:
        flat = torch.frombuffer(view, dtype=torch.uint8)
        if flat.data_ptr() % dtype.itemsize:
            flat, copied = _copy_bytes(view), len(view)
    return flat.view(dtype).view(meta.shape), copied


def _copy_bytes(view: memoryview) -> torch.Tensor:
    out = torch.empty(len(view), dtype=torch.uint8)  # torch's allocator aligns to 64 bytes
    out.numpy()[:] = np.frombuffer(view, dtype=np.uint8)
    return out


def _as_bytes_view(i: int, frame: Any) -> memoryview:
    if isinstance(frame, str):
        raise WireError(f"frame {i} is a str, not a bytes-like buffer")
    try:
        view = memoryview(frame)  # bytes, bytearray, memoryview, zmq.Frame, ndarray
        if not view.c_contiguous:
            raise ValueError("the buffer is strided")
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as e:
        raise WireError(f"frame {i} is not a contiguous bytes-like buffer: {e}") from None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- errors across the wire


def error_message(msg_id: int, exc: BaseException) -> list:
    """``ERROR`` frames answering ``msg_id`` with ``{"type": class name, "message": str}``.

    A :class:`RemoteError` being passed on keeps the type name of its origin.
    """
    if isinstance(exc, RemoteError):
        kind, text = exc.remote_type, exc.remote_message
    else:
        kind, text = type(exc).__name__, str(exc)
    if len(text) > MAX_ERROR_TEXT:
        text = text[:MAX_ERROR_TEXT] + "... (truncated)"
    return encode(Kind.ERROR, msg_id, {"type": kind, "message": text})


def raise_if_error(msg: Message) -> Message:
    """Return ``msg`` unless it is an ``ERROR``; then raise the matching typed exception.

    Type names of :mod:`tokenlake.core.errors` (and ``WireError``) map to those classes;
    any other name raises :class:`RemoteError` carrying it (no other class is ever
    instantiated from a name that came over the wire).
    """
    if msg.kind != Kind.ERROR:
        return msg
    name, text = msg.body.get("type"), msg.body.get("message")
    if not isinstance(name, str) or not isinstance(text, str):
        raise WireError(f"ERROR body {_short(msg.body)} lacks str 'type' and 'message'")
    cls = _known_errors().get(name)
    try:
        exc = RemoteError(name, text) if cls is None else cls(text)
    except Exception:  # a known class whose constructor wants more than a message
        exc = RemoteError(name, text)
    raise exc


def _known_errors() -> dict[str, type[TokenLakeError]]:
    known = {
        name: obj
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, TokenLakeError)
    }
    known[WireError.__name__] = WireError
    return known


# ---------------------------------------------------------------- sockets


#: Frames at least this large go without copying; smaller ones are copied into the
#: zmq message. A zero-copy frame costs pyzmq a buffer-lifetime hand-off to its garbage
#: collector thread (measured ~0.8 ms per message on a 2-core VM), far more than
#: copying a header or a few KiB.
ZERO_COPY_MIN_BYTES = 64 * 1024


def send_frames(sock: zmq.Socket, frames: Sequence, flags: int = 0) -> None:
    """Sends one multipart message: large frames zero-copy, small ones copied (the
    copy of a small frame is zmq's, not counted in :class:`CopyStats`)."""
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


def recv(sock: zmq.Socket, timeout_s: float, *, peer: str | None = None) -> Message:
    """Receive and decode one message, waiting at most ``timeout_s`` seconds.

    Raises:
        EngineUnavailable: nothing arrived in time (or the socket failed); the message
            names ``peer`` (default: the socket's last endpoint) and the timeout.
        WireError: the message is malformed.
    """
    return decode(_recv_frames(sock, timeout_s, peer))


def recv_routed(
    sock: zmq.Socket, timeout_s: float, *, peer: str | None = None
) -> tuple[tuple, Message]:
    """On a ROUTER socket: ``(envelope, message)``; answer with :func:`send_routed`.

    The envelope is the peer's identity frame, plus the empty delimiter frame when the
    peer is a REQ socket. Peers connect directly (no proxies in between). A malformed
    message raises :class:`WireError` with ``envelope`` (and ``msg_id`` when known) set,
    so the server can reply ``ERROR`` and keep serving.
    """
    frames = _recv_frames(sock, timeout_s, peer)
    cut = 2 if len(frames) > 1 and len(frames[1]) == 0 else 1
    envelope = tuple(frames[:cut])
    try:
        if len(frames) <= cut:
            raise WireError("routed message has an envelope but no header frame")
        return envelope, decode(frames[cut:])
    except WireError as e:
        e.envelope = envelope
        raise


def send_routed(
    sock: zmq.Socket, envelope: Sequence | bytes, frames: list, *, timeout_s: float | None = None
) -> None:
    """Send ``frames`` on a ROUTER socket to the peer named by ``envelope``."""
    head = [envelope] if isinstance(envelope, (bytes, zmq.Frame)) else list(envelope)
    send(sock, [*head, *frames], timeout_s=timeout_s)


def bind_address(host: str = "127.0.0.1", port: int | None = None) -> str:
    """A zmq TCP endpoint to bind: ``tcp://127.0.0.1:*`` (any free port) by default.

    Loopback is the default (DESIGN §4); other hosts only when configured, and the
    protocol has no authentication, so a non-loopback host is logged as a warning.
    Find the port actually bound with ``sock.getsockopt_string(zmq.LAST_ENDPOINT)``.
    """
    if not isinstance(host, str) or not host or any(c.isspace() or c in "/" for c in host):
        raise ValueError(f"host must be a hostname or IP address, got {host!r}")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535
    ):
        raise ValueError(f"port must be in [1, 65535] or None (any free port), got {port!r}")
    if not _is_loopback(host):
        log.warning(
            "binding %s: the wire protocol has no authentication; trusted networks only", host
        )
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal (the socket also needs zmq.IPV6 set)
    return f"tcp://{host}:{'*' if port is None else port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _recv_frames(sock: zmq.Socket, timeout_s: float, peer: str | None) -> list:
    ms = _timeout_ms(timeout_s)
    try:
        if sock.poll(ms, zmq.POLLIN):
            return sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        pass
    except zmq.ZMQError as e:
        raise EngineUnavailable(f"receiving from {peer or _peer(sock)} failed: {e}") from e
    raise EngineUnavailable(f"no message from {peer or _peer(sock)} within {timeout_s:g} s")


def _timeout_ms(timeout_s: float) -> int:
    if not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a finite number >= 0 (seconds), got {timeout_s!r}")
    return math.ceil(timeout_s * 1000)


def _peer(sock: zmq.Socket) -> str:
    try:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT) or "peer"
    except zmq.ZMQError:
        return "peer (socket closed)"

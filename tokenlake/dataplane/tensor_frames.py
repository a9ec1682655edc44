"""Tensor frames of the wire format: the dtype allowlist, what the header says about a
tensor (:class:`TensorMeta`), and the zero-copy conversion between tensors and frames.

A tensor frame is the tensor's raw bytes: C order, little-endian, no padding,
``prod(shape) * itemsize`` bytes (``docs/protocol.md``, *Framing*). This module is the
lowest of the wire modules: :mod:`tokenlake.dataplane.wire` (the header, kinds and
encode/decode) builds on it, and it defines :class:`WireError`, the one error a
malformed message ever raises.

Copies (counted in :class:`CopyStats`):

* :func:`tensor_to_frame` never copies a CPU tensor (a CUDA one is staged through host
  memory, counted). The frame is a ``memoryview`` of the tensor's
  own storage; a non-contiguous tensor is refused (:class:`WireError`) rather than
  silently made contiguous. Do not write to a tensor until its message has left (for a
  request: until the reply arrived).
* :func:`frame_to_tensor` wraps the frame with ``torch.frombuffer`` (zero copy) when the
  buffer is writable and aligned to the dtype's item size; the tensor then aliases the
  frame (pyzmq >= 23 hands out writable frame buffers). It copies the frame into fresh
  memory when the buffer is read-only (``bytes``, a ``recv_multipart(copy=True)``
  result): a tensor over immutable memory would make any in-place op undefined
  behaviour, and ``torch.frombuffer`` warns about exactly that. It also copies when the
  address is misaligned (libzmq's TCP decoder may place small messages at odd offsets).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenlake.core.errors import TokenLakeError

MAX_NDIM = 16  # most dimensions a tensor may declare

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


class WireError(TokenLakeError):
    """A message is malformed (or cannot be encoded).

    Raised for bad msgpack, another protocol version, an unknown kind, a frame count or
    frame size that does not match the header, a dtype off the allowlist, a bad shape,
    a body that is not msgpack-native, a body field of the wrong type for its kind
    (:mod:`tokenlake.dataplane.messages`; the message names the field), or a
    non-contiguous tensor to send.

    ``msg_id`` is the message's id when the header was readable far enough to tell, so a
    server can answer with an ``ERROR`` carrying it; ``envelope`` is set by
    :func:`tokenlake.dataplane.wire.recv_routed` so the server knows whom to answer;
    ``field`` is the path of the body field at fault (``"tasks[0][1]"``) when a typed
    message refused its body. Only the class name and the text cross the wire.
    """

    msg_id: int | None = None
    envelope: tuple[bytes, ...] | None = None
    field: str | None = None


class CopyStats:
    """Process-wide count of tensor bytes that the wire copied (tests assert zeros).

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
    def record(cls, nbytes: int) -> None:
        """Counts one message for which ``nbytes`` payload bytes were copied."""
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
            raise WireError(f"dtype {short(self.dtype)} is not one of {sorted(DTYPES)}")
        if len(self.shape) > MAX_NDIM:
            raise WireError(f"shape has {len(self.shape)} dimensions (at most {MAX_NDIM})")
        for d in self.shape:
            if not isinstance(d, int) or isinstance(d, bool):
                raise WireError(f"shape {short(self.shape)} has a non-integer dimension")
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
            raise WireError(f"tensor entry {short(entry)} is not [dtype, [shape...]]")
        return cls(entry[0], tuple(entry[1]))


def tensor_to_frame(i: int, t: Any) -> tuple[TensorMeta, memoryview]:
    """The meta of tensor ``i`` (a CPU torch tensor or numpy array) and a flat uint8
    memoryview of its own storage: no copy; the view keeps the storage alive. A dense
    CUDA tensor (a GPU pool's rows or partials going to another instance) is staged
    through host memory first: one device-to-host copy, counted in ``CopyStats``.

    Raises:
        WireError: not dense, on a device other than the CPU or CUDA, a dtype off the
            allowlist, non-native byte order, or not C-contiguous.
    """
    if isinstance(t, torch.Tensor):
        if t.is_cuda and t.layout == torch.strided and t.is_contiguous():
            CopyStats.record(t.numel() * t.element_size())
            t = t.cpu()
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


def frame_to_tensor(meta: TensorMeta, view: memoryview) -> tuple[torch.Tensor, int]:
    """The tensor ``meta`` describes over ``view`` (whose size the caller checked) and
    how many bytes had to be copied to build it (0 when it aliases the frame)."""
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


def as_bytes_view(i: int, frame: Any) -> memoryview:
    """Frame ``i`` (bytes, bytearray, memoryview, zmq.Frame, ndarray) as a flat byte view.

    Raises:
        WireError: a str, or a buffer that is not contiguous bytes.
    """
    if isinstance(frame, str):
        raise WireError(f"frame {i} is a str, not a bytes-like buffer")
    try:
        view = memoryview(frame)
        if not view.c_contiguous:
            raise ValueError("the buffer is strided")
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as e:
        raise WireError(f"frame {i} is not a contiguous bytes-like buffer: {e}") from None


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (error messages quote peer input)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

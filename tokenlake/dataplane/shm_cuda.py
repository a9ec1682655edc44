"""CUDA buffers shared between processes by CUDA IPC handle (docs/design.md §4 "Shared buffers").

The CUDA half of :class:`tokenlake.dataplane.shm.SharedTensor`, which imports this module
only for a ``cuda`` spec (it loads torch and msgpack). A CUDA buffer has no file and no
name in any namespace: the owner allocates a tensor and hands its IPC handle to peers
inside the :class:`~tokenlake.dataplane.shm.BufferSpec` (``ipc_handle``); a peer rebuilds
a tensor over the same device memory from it, with no copy.

The handle is torch's own (``Storage._share_cuda_`` via ``reduce_tensor``) minus the Python
classes, packed with msgpack as the list ``[version=1, storage offset (elements), stride
(elements), device index, memory handle, storage size (bytes), storage offset (bytes),
ref-counter handle, ref-counter offset, event handle, event sync flag]``. The owner must keep
its buffer until its peers have closed theirs: torch counts one consumer per share, and all
peers attach from the same share.
"""

from __future__ import annotations

from dataclasses import replace

import msgpack
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from tokenlake.dataplane.shm_files import (
    BufferMissing,
    BufferSizeMismatch,
    BufferSpec,
    SharedMemoryError,
)

HANDLE_VERSION = 1


def _require_cuda(spec: BufferSpec) -> None:
    if not torch.cuda.is_available():
        raise SharedMemoryError(f"{spec.name!r} is a {spec.device} buffer but CUDA is unavailable")


def cuda_create(spec: BufferSpec) -> tuple[BufferSpec, torch.Tensor]:
    """Allocate a zero-filled tensor of ``spec.shape`` / ``spec.dtype`` on ``spec.device``.

    Returns:
        ``(spec with ipc_handle filled in, the tensor)``: contiguous, owned by the caller;
        give the returned spec to peers.

    Raises:
        SharedMemoryError: CUDA is unavailable.
    """
    _require_cuda(spec)
    t = torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device=spec.device)
    _, args = reduce_tensor(t)
    # args: cls, size, stride, offset, storage_cls, dtype, device, handle, size_bytes,
    # offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle, sync
    handle = msgpack.packb([HANDLE_VERSION, args[3], list(args[2]), *args[6:10], *args[11:15]])
    return replace(spec, ipc_handle=handle), t


def cuda_attach(spec: BufferSpec) -> torch.Tensor:
    """A tensor of ``spec.shape`` / ``spec.dtype`` over the owner's device memory, no copy.

    Raises:
        BufferMissing: the spec carries no ``ipc_handle`` (pass the owner's ``spec`` on).
        BufferSizeMismatch: the shared storage is smaller than the spec needs (bytes).
        SharedMemoryError: CUDA is unavailable, or the handle is malformed or of another
            version.
    """
    _require_cuda(spec)
    if spec.ipc_handle is None:
        raise BufferMissing(f"CUDA buffer {spec.name!r}: spec has no ipc_handle (use owner.spec)")
    try:
        version, offset, stride, dev, h, size_b, off_b, rc_h, rc_off, ev_h, sync = msgpack.unpackb(
            spec.ipc_handle
        )
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise SharedMemoryError(f"CUDA buffer {spec.name!r}: malformed ipc_handle") from e
    if version != HANDLE_VERSION:
        raise SharedMemoryError(f"CUDA buffer {spec.name!r}: ipc_handle version {version}")
    dtype = getattr(torch, spec.dtype)
    need = (offset + spec.numel) * dtype.itemsize
    if size_b < need:
        raise BufferSizeMismatch(f"CUDA buffer {spec.name!r} has {size_b} bytes, spec needs {need}")
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(spec.shape), tuple(stride), offset, torch.UntypedStorage,
        dtype, dev, h, size_b, off_b, False, rc_h, rc_off, ev_h, sync,
    )  # fmt: skip

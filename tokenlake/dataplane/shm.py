"""Named shared tensors: POSIX shared memory on CPU, CUDA IPC on GPU (docs/design.md §4 "Shared buffers").

A compute engine and its query/transfer engines share ``q_buf``, ``kv_buf`` and ``out_buf``
without copies. The owner :meth:`SharedTensor.create` s a buffer from a :class:`BufferSpec`
and hands the spec (plain data, msgpack-friendly via :meth:`BufferSpec.to_dict`) to its
peers, which :meth:`SharedTensor.attach`. ``SharedTensor.tensor`` is a writable view of the
shared memory itself in every process.

Three modules, one per concern:

* :mod:`tokenlake.dataplane.shm_files`: the POSIX layer (a CPU buffer is a file in
  ``/dev/shm``): names, errors, creating a buffer without mapping it, listing, unlinking,
  sweeping the buffers of dead creators. Pure standard library.
* :mod:`tokenlake.dataplane.shm_cuda`: CUDA buffers shared by IPC handle (loads torch).
* this module: :class:`BufferSpec`, :class:`SharedTensor` (a buffer mapped as a tensor)
  and :class:`BufferRegistry` (the owner's bookkeeping and cleanup).

Cleanup. The launcher creates buffers through a :class:`BufferRegistry`, whose
``cleanup()`` (also run at exit) unlinks them, plus everything else under the cluster
prefix, so a crashed child leaves nothing behind. Buffers of a launcher that itself died
(SIGKILL: no atexit) are removed by :func:`~tokenlake.dataplane.shm_files.sweep_stale`.

Copy accounting lives in :class:`tokenlake.dataplane.tensor_frames.CopyStats`: sharing a
buffer copies nothing, so the only copies on the CPU data path are the wire's, counted there.

torch is imported lazily (only to map a buffer): specs and the registry's bookkeeping load
without it, so the Ray launcher and its host actors stay torch-free.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import TYPE_CHECKING

from tokenlake.dataplane.shm_files import (
    BufferFile,
    BufferMissing,
    BufferSizeMismatch,
    BufferSpec,
    SharedMemoryError,
    create_buffer,
    stat_buffer,
    unlink_buffer,
    unlink_prefix,
)

if TYPE_CHECKING:
    import torch

# --------------------------------------------------------------------------- shared tensors


class SharedTensor:
    """A tensor in memory shared between processes, by name (CPU) or IPC handle (CUDA).

    Build with :meth:`create` (owner) or :meth:`attach` (peer), never directly.
    ``tensor`` is a writable, contiguous view of the shared memory with ``spec.shape`` and
    ``spec.dtype``: writes are seen by every process that attached, with no copy.

    ``close()`` drops this object's reference to the mapping; the memory is unmapped once
    no view of it is alive any more (views taken from ``tensor`` keep it mapped, safely).
    ``unlink()`` (owner only) removes the name: later attaches fail; existing mappings keep
    working and the memory is freed when the last one goes. Both are idempotent. As a
    context manager the owner closes and unlinks on exit, a peer only closes.
    """

    def __init__(self, spec: BufferSpec, tensor: torch.Tensor, owner: bool) -> None:
        self.spec = spec  # for CUDA, carries the ipc_handle to give to peers
        self.owner = owner
        self._tensor: torch.Tensor | None = tensor
        self._unlinked = False

    @classmethod
    def create(cls, spec: BufferSpec) -> SharedTensor:
        """Create a new zero-filled buffer. Raises :class:`BufferExists` if the name is taken."""
        if spec.is_cuda:
            from tokenlake.dataplane import shm_cuda  # loads torch: only for CUDA specs

            spec, tensor = shm_cuda.cuda_create(spec)
        else:
            tensor = _cpu_create(spec)
        return cls(spec, tensor, owner=True)

    @classmethod
    def attach(cls, spec: BufferSpec) -> SharedTensor:
        """Map an existing buffer. Raises :class:`BufferMissing` or :class:`BufferSizeMismatch`."""
        if spec.is_cuda:
            from tokenlake.dataplane import shm_cuda  # loads torch: only for CUDA specs

            tensor = shm_cuda.cuda_attach(spec)
        else:
            tensor = _cpu_attach(spec)
        return cls(spec, tensor, owner=False)

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise SharedMemoryError(f"shared buffer {self.spec.name!r} is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def close(self) -> None:
        self._tensor = None

    def unlink(self) -> None:
        if not self.owner:
            raise SharedMemoryError(f"only the owner may unlink {self.spec.name!r}")
        if not self._unlinked:
            self._unlinked = True
            if not self.spec.is_cuda:  # a CUDA allocation has no name; close() releases it
                unlink_buffer(self.spec.name)

    def __enter__(self) -> SharedTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        role = "owner" if self.owner else "peer"
        state = "closed" if self.closed else "open"
        s = self.spec
        return f"SharedTensor({s.name!r}, {s.shape}, {s.dtype}, {s.device}, {role}, {state})"


# --------------------------------------------------------------------------- CPU mapping


def _map(file: BufferFile, spec: BufferSpec) -> torch.Tensor:
    """mmap(MAP_SHARED) the buffer's file as a tensor of ``spec.shape`` / ``spec.dtype``, no copy.

    ``torch.from_file(shared=True)`` opens by path with O_CREAT and *grows* a short file,
    so callers check the size first, and we re-check the inode afterwards: a name that was
    unlinked (and possibly recreated by from_file itself) in between must not be used.
    """
    import torch  # lazily: importing this module must not load torch (see the module doc)

    t = torch.from_file(file.path, shared=True, size=spec.numel, dtype=getattr(torch, spec.dtype))
    if not file.is_current():
        raise BufferMissing(f"shared buffer {spec.name!r} was unlinked while being mapped")
    return t.view(spec.shape)


def _cpu_create(spec: BufferSpec) -> torch.Tensor:
    file = create_buffer(spec.name, spec.nbytes)
    try:
        return _map(file, spec)
    except BaseException:
        unlink_buffer(spec.name)
        raise


def _cpu_attach(spec: BufferSpec) -> torch.Tensor:
    file = stat_buffer(spec.name)
    if file.nbytes != spec.nbytes:
        # No header in the file (data starts at offset 0 for from_file), so only the byte
        # size can be checked: pass the owner's spec on verbatim.
        raise BufferSizeMismatch(
            f"shared buffer {spec.name!r} has {file.nbytes} bytes, spec {spec.shape} "
            f"{spec.dtype} needs {spec.nbytes}"
        )
    return _map(file, spec)


# --------------------------------------------------------------------------- registry


class BufferRegistry:
    """Owner-side lifetime of a cluster's shared buffers (used by the cluster launcher).

    ``create(spec)`` creates and tracks a buffer. ``cleanup()`` closes and unlinks every
    buffer it created and, when the registry has a ``prefix``, every other buffer under it
    too (e.g. one a child engine created before it crashed). It is idempotent and runs at
    interpreter exit (atexit; only in the process that made the registry, not in a fork).
    A SIGKILLed launcher runs nothing: :func:`sweep_stale` covers that.
    """

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix
        self._buffers: dict[str, SharedTensor] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._atexit = False

    def create(self, spec: BufferSpec) -> SharedTensor:
        return self._track(spec, lambda: SharedTensor.create(spec))

    def adopt(self, spec: BufferSpec) -> SharedTensor:
        """Maps an existing CPU buffer under this registry's prefix and takes over its
        lifetime as if it had been created here (a new control process adopting the
        buffers of one that died: docs/design.md §4 "Restart")."""
        if spec.is_cuda:
            raise SharedMemoryError("a CUDA buffer dies with the process that made it: "
                                    f"{spec.name!r} cannot be adopted")
        return self._track(spec, lambda: SharedTensor(spec, _cpu_attach(spec), owner=True))

    def _track(self, spec: BufferSpec, make) -> SharedTensor:
        """``make()``'s buffer, kept for :meth:`cleanup` (it must be under the prefix)."""
        if self.prefix is not None and not spec.name.startswith(self.prefix):
            raise SharedMemoryError(f"{spec.name!r} is outside this registry's {self.prefix!r}")
        with self._lock:
            if not self._atexit:
                atexit.register(self._cleanup_at_exit)
                self._atexit = True
            st = self._buffers[spec.name] = make()
            return st

    @property
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._buffers)

    def cleanup(self) -> list[str]:
        """Unlink everything; returns the names that were still present and got removed."""
        with self._lock:
            buffers, self._buffers = self._buffers, {}
            if self._atexit:
                atexit.unregister(self._cleanup_at_exit)
                self._atexit = False
        removed = []
        for name, st in buffers.items():
            st.close()
            if st.spec.is_cuda:
                st.unlink()
            elif unlink_buffer(name):
                removed.append(name)
        if self.prefix is not None:
            removed += unlink_prefix(self.prefix)
        return removed

    def _cleanup_at_exit(self) -> None:
        if os.getpid() == self._pid:
            self.cleanup()

    def __enter__(self) -> BufferRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

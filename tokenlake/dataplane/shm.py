"""Named shared tensors: POSIX shared memory on CPU, CUDA IPC on GPU (DESIGN §4 "Shared buffers").

A compute engine and its query/transfer engines share ``q_buf``, ``kv_buf`` and ``out_buf``
without copies. The owner :meth:`SharedTensor.create` s a buffer from a :class:`BufferSpec`
and hands the spec (plain data, msgpack-friendly via :meth:`BufferSpec.to_dict`) to its
peers, which :meth:`SharedTensor.attach`. ``SharedTensor.tensor`` is a writable view of the
shared memory itself in every process.

Vocabulary: a *buffer* is one named block of shared memory (a file in ``/dev/shm`` on
CPU); "segment" in this project always means a KV segment of the pool
(:class:`~tokenlake.core.errors.SegmentNotFound`), never a shared-memory object.

Naming and cleanup. Buffer names start with :func:`cluster_prefix` of a cluster id that
carries the launcher's pid (:func:`new_cluster_id`). The launcher creates buffers through a
:class:`BufferRegistry`, whose ``cleanup()`` (also run at exit) unlinks them, plus everything
else under the cluster prefix, so a crashed child leaves nothing behind. Buffers of a
launcher that itself died (SIGKILL: no atexit) are removed by :func:`sweep_stale`.

Copy accounting lives in :class:`tokenlake.dataplane.wire.CopyStats`: sharing a buffer copies
nothing, so the only copies on the CPU data path are the wire's, counted there.

torch is imported lazily: naming, sweeping and specs work without it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import re
import secrets
import tempfile
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tokenlake.core.errors import TokenLakeError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PREFIX = "tokenlake-"
_DEV_SHM = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")
_CREATOR_RE = re.compile(r"^tokenlake-(\d+)-")
# Bytes per element of the dtypes a buffer may have (names as in ``torch.<name>``).
_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip


class SharedMemoryError(TokenLakeError):
    """A shared buffer cannot be created, attached or used."""


class BufferExists(SharedMemoryError, FileExistsError):
    """``create`` named a buffer that already exists (never silently reused)."""


class BufferMissing(SharedMemoryError, FileNotFoundError):
    """``attach`` named a buffer that does not exist (never created, or already unlinked)."""


class BufferSizeMismatch(SharedMemoryError, ValueError):
    """The buffer's size in bytes differs from what the spec's shape and dtype need."""


# --------------------------------------------------------------------------- specs, names


@dataclass(frozen=True)
class BufferSpec:
    """Everything a peer process needs to attach a shared buffer.

    Attributes:
        name: buffer name, ``[A-Za-z0-9_.-]``, at most 200 characters, no leading dot;
            normally ``cluster_prefix(cluster_id) + role``, e.g. ``"tokenlake-4242-9f3a0c1e-i0-q"``.
        shape: tensor shape (elements); every dimension > 0.
        dtype: a key of the dtype table, as ``torch.<dtype>`` is named: ``"float32"``, ...
        device: ``"cpu"`` (POSIX shm) or ``"cuda"`` / ``"cuda:N"`` (CUDA IPC).
        ipc_handle: CUDA only: the opaque IPC handle, filled in by ``create``
            (read it from ``SharedTensor.spec``); ``None`` on CPU.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str = "cpu"
    ipc_handle: bytes | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))  # msgpack gives lists
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise SharedMemoryError(f"invalid buffer name {self.name!r} (want {_NAME_RE.pattern})")
        if not self.shape or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in self.shape
        ):
            raise SharedMemoryError(f"shape must be positive ints, got {self.shape!r}")
        if self.dtype not in _ITEMSIZE:
            raise SharedMemoryError(f"dtype {self.dtype!r} not one of {sorted(_ITEMSIZE)}")
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise SharedMemoryError(
                f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        if self.ipc_handle is not None and not self.is_cuda:
            raise SharedMemoryError("ipc_handle is for CUDA buffers only")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _ITEMSIZE[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, list of int, bytes/None) for a msgpack header."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "device": self.device,
            "ipc_handle": self.ipc_handle,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BufferSpec:
        try:
            shape = tuple(d["shape"])
            return cls(d["name"], shape, d["dtype"], d.get("device", "cpu"), d.get("ipc_handle"))
        except (KeyError, TypeError) as e:
            raise SharedMemoryError(f"malformed buffer spec {d!r}: {e}") from e


def new_cluster_id() -> str:
    """A fresh cluster id ``"<pid>-<8 hex>"``; the pid lets :func:`sweep_stale` find orphans."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def cluster_prefix(cluster_id: str) -> str:
    """``"tokenlake-<cluster_id>-"``: the name prefix of every buffer of one cluster."""
    if not re.fullmatch(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*", cluster_id or ""):
        raise SharedMemoryError(f"invalid cluster id {cluster_id!r}")
    return f"{PREFIX}{cluster_id}-"


def shm_dir() -> str:
    """Where buffers live: ``/dev/shm`` (the POSIX shm namespace, tmpfs, RAM-backed).

    Without ``/dev/shm`` (macOS, some sandboxes) a private temp directory is used instead:
    still shared between processes through ``mmap(MAP_SHARED)``, but possibly disk-backed.
    """
    if os.path.isdir(_DEV_SHM):
        return _DEV_SHM
    d = os.path.join(tempfile.gettempdir(), "tokenlake-shm")
    if not os.path.isdir(d):
        log.warning("%s does not exist; shared buffers fall back to %s", _DEV_SHM, d)
        os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def list_buffers(prefix: str = PREFIX) -> list[str]:
    """Names of the existing CPU buffers that start with ``prefix``, sorted."""
    return sorted(n for n in os.listdir(shm_dir()) if n.startswith(prefix))


def unlink_buffer(name: str) -> bool:
    """Remove a CPU buffer's name (mappings stay valid until unmapped). False if already gone."""
    try:
        os.unlink(os.path.join(shm_dir(), name))
    except FileNotFoundError:
        return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:  # an unreaped zombie answers kill(0) but will never clean up
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Unlink buffers under ``prefix`` whose creator pid (``tokenlake-<pid>-...``) is dead.

    Names without a parsable pid are kept. Conservative by design: a recycled pid keeps its
    orphans alive until the next sweep. Caveat: pids are read in *this* pid namespace, so
    do not share /dev/shm between containers with separate pid namespaces and sweep there.
    Returns the names removed.
    """
    removed = []
    for name in list_buffers(prefix):
        m = _CREATOR_RE.match(name)
        if m and not _pid_alive(int(m.group(1))) and unlink_buffer(name):
            removed.append(name)
    if removed:
        log.info("swept %d stale shared buffers: %s", len(removed), removed)
    return removed


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
            spec, tensor = _cuda_create(spec)
        else:
            tensor = _cpu_create(spec)
        return cls(spec, tensor, owner=True)

    @classmethod
    def attach(cls, spec: BufferSpec) -> SharedTensor:
        """Map an existing buffer. Raises :class:`BufferMissing` or :class:`BufferSizeMismatch`."""
        tensor = _cuda_attach(spec) if spec.is_cuda else _cpu_attach(spec)
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


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def _map(path: str, spec: BufferSpec, ino: int) -> torch.Tensor:
    """mmap(MAP_SHARED) the file as a tensor, no copy.

    ``torch.from_file(shared=True)`` opens by path with O_CREAT and *grows* a short file,
    so callers check the size first, and we re-check the inode afterwards: a name that was
    unlinked (and possibly recreated by from_file itself) in between must not be used.
    """
    import torch

    t = torch.from_file(path, shared=True, size=spec.numel, dtype=_torch_dtype(spec.dtype))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is None or st.st_ino != ino:
        raise BufferMissing(f"shared buffer {spec.name!r} was unlinked while being mapped")
    return t.view(spec.shape)


# We do not use multiprocessing.shared_memory: in Python 3.11 every SharedMemory, attached
# ones included, registers with multiprocessing's resource_tracker, which unlinks the buffer
# (with a "leaked shared_memory" warning) when the *attaching* process exits: a peer would
# destroy the owner's buffer. Plain files in /dev/shm plus torch.from_file avoid the tracker;
# lifetime is ours (BufferRegistry, sweep_stale).
def _cpu_create(spec: BufferSpec) -> torch.Tensor:
    path = os.path.join(shm_dir(), spec.name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError as e:
        raise BufferExists(f"shared buffer {spec.name!r} already exists at {path}") from e
    try:
        try:
            # Reserve the pages now: a sparse tmpfs file that later cannot get its pages
            # (a small /dev/shm, e.g. Docker's 64 MiB default) kills the writer with SIGBUS.
            os.posix_fallocate(fd, 0, spec.nbytes)
        except AttributeError:  # no posix_fallocate (macOS): sparse, still zero-filled
            os.ftruncate(fd, spec.nbytes)
        except OSError as e:
            raise SharedMemoryError(
                f"cannot allocate {spec.nbytes} bytes for {spec.name!r} in {shm_dir()}: {e}"
            ) from e
        ino = os.fstat(fd).st_ino
        os.close(fd)
        fd = -1
        return _map(path, spec, ino)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise


def _cpu_attach(spec: BufferSpec) -> torch.Tensor:
    path = os.path.join(shm_dir(), spec.name)
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise BufferMissing(f"no shared buffer {spec.name!r} at {path}") from e
    if st.st_size != spec.nbytes:
        # No header in the file (data starts at offset 0 for from_file), so only the byte
        # size can be checked: pass the owner's spec on verbatim.
        raise BufferSizeMismatch(
            f"shared buffer {spec.name!r} has {st.st_size} bytes, spec {spec.shape} "
            f"{spec.dtype} needs {spec.nbytes}"
        )
    return _map(path, spec, st.st_ino)


# --------------------------------------------------------------------------- CUDA IPC
# The handle is torch's own (Storage._share_cuda_ via reduce_tensor) minus the Python classes,
# packed with msgpack. The owner must keep its buffer until its peers have closed theirs:
# torch counts one consumer per share, and all peers attach from the same share.


def _require_cuda(spec: BufferSpec) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SharedMemoryError(f"{spec.name!r} is a {spec.device} buffer but CUDA is unavailable")


def _cuda_create(spec: BufferSpec) -> tuple[BufferSpec, torch.Tensor]:
    import msgpack
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    _require_cuda(spec)
    t = torch.zeros(spec.shape, dtype=_torch_dtype(spec.dtype), device=spec.device)
    _, args = reduce_tensor(t)
    # args: cls, size, stride, offset, storage_cls, dtype, device, handle, size_bytes,
    # offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle, sync
    handle = msgpack.packb([1, args[3], list(args[2]), *args[6:10], *args[11:15]])
    return replace(spec, ipc_handle=handle), t


def _cuda_attach(spec: BufferSpec) -> torch.Tensor:
    import msgpack
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    _require_cuda(spec)
    if spec.ipc_handle is None:
        raise BufferMissing(f"CUDA buffer {spec.name!r}: spec has no ipc_handle (use owner.spec)")
    try:
        version, offset, stride, dev, h, size_b, off_b, rc_h, rc_off, ev_h, sync = msgpack.unpackb(
            spec.ipc_handle
        )
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise SharedMemoryError(f"CUDA buffer {spec.name!r}: malformed ipc_handle") from e
    if version != 1:
        raise SharedMemoryError(f"CUDA buffer {spec.name!r}: ipc_handle version {version}")
    dtype = _torch_dtype(spec.dtype)
    need = (offset + spec.numel) * dtype.itemsize
    if size_b < need:
        raise BufferSizeMismatch(f"CUDA buffer {spec.name!r} has {size_b} bytes, spec needs {need}")
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(spec.shape), tuple(stride), offset, torch.UntypedStorage,
        dtype, dev, h, size_b, off_b, False, rc_h, rc_off, ev_h, sync,
    )  # fmt: skip


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
        if self.prefix is not None and not spec.name.startswith(self.prefix):
            raise SharedMemoryError(f"{spec.name!r} is outside this registry's {self.prefix!r}")
        with self._lock:
            if not self._atexit:
                atexit.register(self._cleanup_at_exit)
                self._atexit = True
            st = SharedTensor.create(spec)
            self._buffers[spec.name] = st
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
            removed += [n for n in list_buffers(self.prefix) if unlink_buffer(n)]
        return removed

    def _cleanup_at_exit(self) -> None:
        if os.getpid() == self._pid:
            self.cleanup()

    def __enter__(self) -> BufferRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


"""Named shared-memory buffers as files: create, list, unlink, sweep (docs/design.md §4 "Shared buffers").

The POSIX layer under :mod:`tokenlake.dataplane.shm`. A CPU buffer is one file in the
shared-memory directory (:func:`shm_dir`, normally ``/dev/shm``), named by its buffer name
and holding exactly the buffer's bytes from offset 0 (no header). This module creates such a
file without mapping it (:func:`create_buffer`), so a process that only owns buffers (the
Ray host actor) needs no torch; :class:`~tokenlake.dataplane.shm.SharedTensor` maps the
file as a tensor on top of it. Pure standard library: importing it loads neither torch nor
msgpack.

Vocabulary: a *buffer* is one named block of shared memory; "segment" in this project
always means a KV segment of the pool (:class:`~tokenlake.core.errors.SegmentNotFound`),
never a shared-memory object.

Naming and cleanup. Buffer names start with :func:`cluster_prefix` of a cluster id that
carries the creating process's pid (:func:`new_cluster_id`), so :func:`sweep_stale` can
remove the buffers of a creator that died without cleaning up (SIGKILL runs no atexit).

We do not use ``multiprocessing.shared_memory``: in Python 3.11 every ``SharedMemory``,
attached ones included, registers with multiprocessing's resource tracker, which unlinks
the buffer (with a "leaked shared_memory" warning) when the *attaching* process exits: a
peer would destroy the owner's buffer. Plain files avoid the tracker; lifetime is ours
(``BufferRegistry``, the Ray host actor, :func:`sweep_stale`).
"""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from typing import Any

from tokenlake.core.errors import TokenLakeError

log = logging.getLogger(__name__)

PREFIX = "tokenlake-"
_DEV_SHM = "/dev/shm"
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")
_CREATOR_RE = re.compile(r"^tokenlake-(\d+)-")
_CLUSTER_RE = re.compile(r"^(tokenlake-\d+-[^-]+-)")


class SharedMemoryError(TokenLakeError):
    """A shared buffer cannot be created, attached or used."""


class BufferExists(SharedMemoryError, FileExistsError):
    """``create`` named a buffer that already exists (never silently reused)."""


class BufferMissing(SharedMemoryError, FileNotFoundError):
    """``attach`` named a buffer that does not exist (never created, or already unlinked)."""


class BufferSizeMismatch(SharedMemoryError, ValueError):
    """The buffer's size in bytes differs from what the spec's shape and dtype need."""


# --------------------------------------------------------------------------- names


def check_name(name: object) -> str:
    """``name`` if it is a valid buffer name (``[A-Za-z0-9_.-]``, at most 200 characters,
    no leading dot or dash: a plain file name, never a path), else :class:`SharedMemoryError`."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise SharedMemoryError(f"invalid buffer name {name!r} (want {NAME_RE.pattern})")
    return name


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


# --------------------------------------------------------------------------- files


@dataclass(frozen=True)
class BufferFile:
    """One buffer's file as found (or made) at one moment.

    Attributes:
        name: the buffer name (a file name in :func:`shm_dir`).
        path: the file's absolute path.
        nbytes: the file's size in bytes (the buffer's size: there is no header).
        inode: the file's inode number, to tell this file from one that later took its name.
    """

    name: str
    path: str
    nbytes: int
    inode: int

    def is_current(self) -> bool:
        """True if ``path`` still names this very file (not unlinked, not replaced)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except FileNotFoundError:
            return False


def create_buffer(name: str, nbytes: int) -> BufferFile:
    """Create the zero-filled buffer ``name`` of exactly ``nbytes`` bytes, without mapping it.

    The file is made with ``O_CREAT | O_EXCL`` and mode 0600, and its pages are reserved
    at once (``posix_fallocate``): a sparse tmpfs file whose pages cannot be had later (a
    small ``/dev/shm``, e.g. Docker's 64 MiB default) would kill its first writer with
    SIGBUS. Where ``posix_fallocate`` does not exist (macOS) the file is sparse, still
    zero-filled. On any failure after the file was made, it is unlinked again.

    Args:
        name: buffer name (see :func:`check_name`); normally ``cluster_prefix(id) + role``.
        nbytes: size in bytes, >= 1.

    Returns:
        The new file (its inode lets a mapper check that it maps this very file).

    Raises:
        BufferExists: the name is taken (never silently reused).
        SharedMemoryError: invalid name or size, or the pages cannot be reserved.
    """
    check_name(name)
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
        raise SharedMemoryError(
            f"buffer {name!r}: size must be a positive int of bytes, got {nbytes!r}"
        )
    path = os.path.join(shm_dir(), name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError as e:
        raise BufferExists(f"shared buffer {name!r} already exists at {path}") from e
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except AttributeError:  # no posix_fallocate (macOS)
            os.ftruncate(fd, nbytes)
        return BufferFile(name, path, nbytes, os.fstat(fd).st_ino)
    except BaseException as e:
        unlink_buffer(name)
        if isinstance(e, OSError):
            raise SharedMemoryError(
                f"cannot allocate {nbytes} bytes for {name!r} in {shm_dir()}: {e}"
            ) from e
        raise
    finally:
        os.close(fd)


def stat_buffer(name: str) -> BufferFile:
    """The existing buffer ``name``; :class:`BufferMissing` if there is none."""
    path = os.path.join(shm_dir(), check_name(name))
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise BufferMissing(f"no shared buffer {name!r} at {path}") from e
    return BufferFile(name, path, st.st_size, st.st_ino)


def list_buffers(prefix: str = PREFIX, fifos: bool = False) -> list[str]:
    """Names of the existing CPU buffers that start with ``prefix``, sorted; with
    ``fifos``, the doorbells beside them too (named FIFOs: dataplane/doorbell.py)."""
    with os.scandir(shm_dir()) as entries:
        return sorted(e.name for e in entries if e.name.startswith(prefix)
                      and (fifos or e.is_file(follow_symlinks=False)))


def unlink_buffer(name: str) -> bool:
    """Remove a CPU buffer's name (mappings stay valid until unmapped). False if already gone."""
    try:
        os.unlink(os.path.join(shm_dir(), name))
    except FileNotFoundError:
        return False
    return True


def unlink_prefix(prefix: str) -> list[str]:
    """Unlink every buffer (and doorbell) whose name starts with ``prefix``; returns the
    names removed."""
    return [name for name in list_buffers(prefix, fifos=True) if unlink_buffer(name)]


# --------------------------------------------------------------------------- stale buffers


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs (an unreaped zombie counts as gone)."""
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


def _mapped_in(pid: str, marker: str) -> set[str]:
    """The names of the shared buffers under ``marker`` (a path prefix in the shm
    directory) that process ``pid`` maps."""
    found = set()
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                at = line.find(marker)
                if at >= 0:
                    found.add(line[at + len(marker):].split()[0])
    except OSError:  # gone, or not ours to read
        pass
    return found


def mapped_buffers(prefix: str = PREFIX, pids: list[int] | None = None) -> set[str]:
    """Names of the buffers under ``prefix`` that a live process maps (all of this
    machine's processes, or ``pids``), read from ``/proc/PID/maps`` (empty where there
    is no ``/proc``)."""
    marker = os.path.join(shm_dir(), prefix)
    if pids is None:
        try:
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        except OSError:
            return set()
    return {prefix + name for pid in pids for name in _mapped_in(str(pid), marker)}


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Unlink buffers under ``prefix`` whose creator pid (``tokenlake-<pid>-...``) is dead
    and of whose cluster no live process maps a buffer (engines that outlived their
    launcher and wait to be adopted keep theirs: docs/design.md §4 "Restart").

    Names without a parsable pid are kept. Conservative by design: a recycled pid keeps its
    orphans alive until the next sweep. Caveat: pids are read in *this* pid namespace, so
    do not share /dev/shm between containers with separate pid namespaces and sweep there.
    Returns the names removed.
    """
    stale = [n for n in list_buffers(prefix, fifos=True)
             if (m := _CREATOR_RE.match(n)) and not pid_alive(int(m.group(1)))]
    if not stale:
        return []
    in_use = {_cluster_of(n) for n in mapped_buffers(prefix)}
    removed = [n for n in stale if _cluster_of(n) not in in_use and unlink_buffer(n)]
    if removed:
        log.info("swept %d stale shared buffers: %s", len(removed), removed)
    return removed


def _cluster_of(name: str) -> str:
    """The cluster prefix of a buffer name (``tokenlake-<pid>-<hex>-``), or the name."""
    m = _CLUSTER_RE.match(name)
    return m.group(1) if m else name


# Bytes per element of the dtypes a buffer may have (names as in ``torch.<name>``).
_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip


@dataclass(frozen=True)
class BufferSpec:
    """Everything a peer process needs to attach a shared buffer.

    Attributes:
        name: buffer name, ``[A-Za-z0-9_.-]``, at most 200 characters, no leading dot or
            dash (:func:`~tokenlake.dataplane.shm_files.check_name`);
            normally ``cluster_prefix(cluster_id) + role``, e.g. ``"tokenlake-4242-9f3a0c1e-i0-q"``.
        shape: tensor shape (elements); every dimension > 0.
        dtype: a key of the dtype table, as ``torch.<dtype>`` is named: ``"float32"``, ...
        device: ``"cpu"`` (POSIX shm) or ``"cuda"`` / ``"cuda:N"`` (CUDA IPC).
        ipc_handle: CUDA only: the opaque IPC handle (:mod:`tokenlake.dataplane.shm_cuda`),
            filled in by ``create`` (read it from ``SharedTensor.spec``); ``None`` on CPU.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str = "cpu"
    ipc_handle: bytes | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))  # msgpack gives lists
        check_name(self.name)
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

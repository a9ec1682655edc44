"""The disk tier under an instance's slab: segments kept as one file each in a directory.

A segment that leaves the fast tier (the slab) can be kept here instead of dropped, and
brought back on a hit; with the directory on local disk the segments also outlive the
process. This module is the store itself: what a file holds, how it is written so that a
crash never leaves a file that would be read as a segment, how it is checked before its
bytes are used, and which files go when the tier is full. It knows nothing of slabs or
plans; the engines give it a segment's bytes (all its layers, as the slab holds them
slot-major) and its key.

A file is ``<key hex>.seg``: a magic line, the length of a msgpack header, the header
(the key, the pool layout the bytes are in, their length, the digest of each chunk of
them (XXH3-128; blake2b in files written before it), and the caller's ``meta``: what a restart needs to put the segment back
in its place) and the bytes. The chunks (``chunk_bytes``; the transfer engine makes
them one layer of the segment each) are hashed on threads of their own, several at
once, while the next ones are read; a file written before chunks (one ``digest`` of all
its bytes) is still read and checked. It is written to a temporary name in the same directory, flushed to the
disk and renamed, so a reader sees the whole file or none; a temporary file left by a
killed writer is removed when the directory is opened, never adopted. On opening, every
file's header is read and its length checked against the header (a truncated file is
refused and removed); the digest is checked when the bytes are read, and a file that
fails it is removed and reported as :class:`~tokenlake.core.errors.TierCorrupt`, never
returned. A file of another pool layout is left alone and not adopted.

The tier holds at most ``capacity_bytes`` of files (headers included) and evicts the
least recently used segments to make room: reading a segment or writing it counts as a
use; on opening, the files' modification times give the order.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import msgpack

from tokenlake.core.errors import ConfigError, TierCorrupt
from tokenlake.engines.tier_format import (
    HASH,
    LEN,
    MAGIC,
    MAX_CHUNKS,
    digest,
    digest_of,
    read_ahead,
    read_checked,
    read_header,
)
from tokenlake.engines.tier_layers import LayeredReads

SUFFIX = ".seg"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
#: Bytes a file's chunk has when its writer names no size (each chunk has a digest).
CHUNK_BYTES = 4 << 20
#: Threads that hash chunks at once (while the next chunk is read).
HASH_THREADS = 2


class TierFiles(LayeredReads):
    """The files of one instance's disk tier (see the module docstring).

    ``layout``: what identifies the bytes' format (for example the slab's shape per
    segment and its dtype, the model and the segment size); files written with another
    layout are not adopted. ``chunk_bytes``: the bytes of each digest's chunk in the files
    it writes. ``fsync``: flush each file to the disk before it is renamed
    into place (off only where durability does not matter, as in tests). One process owns
    a directory at a time (a lock, released by :meth:`close` or the process's end);
    another that opens it meanwhile gets ConfigError. Its methods may be called from
    several threads (one lock). A caller that keeps its own index of the tier treats a
    KeyError from :meth:`get` as a miss: a :meth:`put` that fails may have evicted segments
    it could not report.
    """

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, layout: Mapping[str, Any],
                 fsync: bool = True, chunk_bytes: int = CHUNK_BYTES) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"the tier's capacity must be > 0 bytes, got {capacity_bytes}")
        if chunk_bytes <= 0:
            raise ConfigError(f"the tier's chunks must have > 0 bytes, got {chunk_bytes}")
        self.chunk_bytes = int(chunk_bytes)
        # threads come with the first digest (xxhash and hashlib let go of the GIL)
        self._hashers = concurrent.futures.ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="tier-hash")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.path / LOCK_NAME, "a+b")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ConfigError(f"the tier directory {self.path} is in use by another process") from None
        self.capacity_bytes = int(capacity_bytes)
        self.layout = msgpack.unpackb(msgpack.packb(dict(layout)))  # as a header reads it back
        self.fsync = fsync
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._meta: dict[bytes, Any] = {}  # what each put was given as meta
        self.used_bytes = 0
        self.refused: list[str] = []  # files not adopted on opening, and why
        self.evictions = 0
        self._mutex = threading.Lock()
        try:
            self._adopt()
        except BaseException:
            self._lock.close()
            raise

    def close(self) -> None:
        """Releases the directory (the files stay), once a read or write in progress is
        over; what comes after is refused (ConfigError)."""
        with self._mutex:
            if not self._lock.closed:
                self._lock.close()  # closing the file releases the lock
        self._hashers.shutdown()

    def __enter__(self) -> TierFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ opening
    def _adopt(self) -> None:
        found = []
        for entry in os.scandir(self.path):
            name = entry.name
            if name.endswith(TMP_SUFFIX):  # a writer died before its rename
                self._refuse(Path(entry.path), f"{name}: partial write")
                continue
            if not name.endswith(SUFFIX) or not entry.is_file():
                continue
            try:
                key, size, layout, meta = self._check_file(Path(entry.path))
            except FileNotFoundError:
                continue
            except ValueError as exc:  # not a whole tier file
                self._refuse(Path(entry.path), f"{name}: {exc}")
                continue
            except OSError as exc:  # cannot be read now: left on disk, not adopted
                self.refused.append(f"{name}: unreadable ({exc.strerror or exc})")
                continue
            if layout != self.layout:
                self.refused.append(f"{name}: another pool layout (kept on disk)")
                continue
            found.append((entry.stat().st_mtime_ns, key, size, meta))
        for _, key, size, meta in sorted(found, key=lambda f: f[:2]):
            self._sizes[key] = size
            self._meta[key] = meta
            self.used_bytes += size
        while self.used_bytes > self.capacity_bytes:  # a smaller tier than the files
            self._evict_one()

    def _check_file(self, path: Path) -> tuple[bytes, int, dict, Any]:
        """The key, size, layout and meta of a complete file; ValueError for anything else."""
        size = path.stat().st_size
        with open(path, "rb") as f:
            header, body_at = read_header(f)
        try:
            key = bytes.fromhex(header["key"])
        except ValueError:
            raise ValueError("its key is not hexadecimal") from None
        if path.name != key.hex() + SUFFIX or header["key"] != key.hex():
            raise ValueError("its name is not its key")
        if size != body_at + header["nbytes"]:
            raise ValueError(f"truncated or padded: {size} bytes, the header says {body_at + header['nbytes']}")
        return key, size, header["layout"], header.get("meta")

    def _refuse(self, path: Path, why: str) -> None:
        """A file found on opening that is not a whole tier file: noted and deleted."""
        self.refused.append(why)
        path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ use
    def _file(self, key: bytes) -> Path:
        return self.path / (key.hex() + SUFFIX)

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> Iterator[bytes]:
        """The segments held, least recently used first."""
        return iter(list(self._sizes))

    def meta(self, key: bytes) -> Any:
        """What :meth:`put` was given as ``meta`` for ``key`` (``None``: nothing)."""
        return self._meta.get(key)

    def put(self, key: bytes, data, meta: Any = None) -> list[bytes]:
        """Keeps ``data`` (bytes-like: the segment's bytes) under ``key``, with ``meta``
        (any msgpack value) in its header, replacing an earlier copy; evicts least
        recently used segments to make room and returns their keys. Raises ConfigError
        if the segment alone exceeds the tier. The new file is complete on disk before
        anything is evicted or replaced."""
        self._check_open()
        view = memoryview(data).cast("B")
        chunk = max(self.chunk_bytes, -(-view.nbytes // MAX_CHUNKS))
        digests = [f.result() for f in self._hash(view, range(0, view.nbytes, chunk), chunk)]
        head = {"key": key.hex(), "layout": self.layout, "nbytes": view.nbytes, "chunk": chunk,
                "hash": HASH, "digests": digests}
        if meta is not None:
            head["meta"] = meta
        header = msgpack.packb(head)
        size = len(MAGIC) + LEN.size + len(header) + view.nbytes
        if size > self.capacity_bytes:
            raise ConfigError(f"a segment of {size} bytes does not fit a tier of {self.capacity_bytes}")
        final = self._file(key)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        with self._mutex:
            self._check_open()
            old = None
            try:
                with open(tmp, "wb") as f:
                    f.write(MAGIC)
                    f.write(LEN.pack(len(header)))
                    f.write(header)
                    f.write(view)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                old = self._sizes.pop(key, None)  # its file is replaced below, atomically
                if old is not None:
                    self.used_bytes -= old
                evicted = []
                while self.used_bytes + size > self.capacity_bytes:
                    evicted.append(self._evict_one())
                os.replace(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                if key not in self._sizes and final.exists() and old is not None:  # the old copy stays
                    self._sizes[key] = old
                    self.used_bytes += old
                raise
            self._sizes[key] = size
            self._meta[key] = meta
            self.used_bytes += size
            return evicted

    def get(self, key: bytes) -> bytearray:
        """The bytes kept under ``key``, checked against their digest. Raises KeyError if
        the tier does not hold it, and TierCorrupt (removing the file) if the file is not
        what was written; another OSError (the disk, the descriptors) is raised as it is
        and the file kept."""
        return self._read(key, bytearray)

    def get_into(self, key: bytes, out) -> None:
        """Reads the bytes kept under ``key`` into ``out`` (a writable buffer of exactly
        their length), checked against their digest: as :meth:`get` without a copy of
        them. Raises as :meth:`get` (``out`` then holds some of the bytes, or none: a
        caller trusts it only after a return), and ValueError if ``out`` is not the
        segment's length (the file is kept)."""
        view = memoryview(out).cast("B")

        def this_buffer(nbytes: int) -> memoryview:
            if nbytes != view.nbytes:
                raise ValueError(f"segment {key.hex()} has {nbytes} bytes, the buffer {view.nbytes}")
            return view

        self._read(key, this_buffer)

    def _read(self, key: bytes, buffer_for):
        """Reads segment ``key`` into ``buffer_for(its length)`` and returns that buffer:
        the disk is asked for the whole file at once and the bytes are hashed a chunk at
        a time as they arrive, so hashing overlaps the reading (:meth:`get`)."""
        with self._mutex:
            self._check_open()
            if key not in self._sizes:
                raise KeyError(key.hex())
            path = self._file(key)
            try:
                f = open(path, "rb", buffering=0)
            except FileNotFoundError as exc:
                self._corrupt(key, path, exc)
            with f:
                try:
                    header, offset = read_header(f)
                    if header["key"] != key.hex():
                        raise ValueError("not this segment")
                except ValueError as exc:
                    self._corrupt(key, path, exc)
                buf = buffer_for(header["nbytes"])  # (a ValueError here keeps the file)
                try:
                    self._read_body(f, offset, memoryview(buf).cast("B"), header)
                except ValueError as exc:
                    self._corrupt(key, path, exc)
            self._sizes.move_to_end(key)
            return buf

    def _hash(self, view: memoryview, starts, chunk: int, algo: str = HASH) -> list[concurrent.futures.Future]:
        """The digests (by ``algo``) of ``view``'s chunks of ``chunk`` bytes that begin at
        ``starts``, hashed on the tier's threads: one future each, in order."""
        try:
            return [self._hashers.submit(digest, view[a:a + chunk], algo) for a in starts]
        except RuntimeError:  # shut down: closed meanwhile (a put hashes before it locks)
            raise ConfigError(f"the tier on {self.path} is closed") from None

    def _read_body(self, f, offset: int, view: memoryview, header: dict) -> None:
        """An open file's bytes from ``offset`` into ``view``, checked as its header says:
        chunk by chunk, or (written before chunks) against one digest; ValueError if
        they are not what was written."""
        if "digests" in header:
            self._read_chunks(f, offset, view, header)
        else:
            read_checked(f, offset, view, header["digest"])

    def _read_chunks(self, f, offset: int, view: memoryview, header: dict) -> None:
        """Reads an open file's bytes from ``offset`` into ``view`` (ValueError if
        there are fewer or more), a chunk at a time: each is hashed on the tier's
        threads while the next is read; ValueError if any does not match its digest."""
        chunk, digests, hashed = header["chunk"], header["digests"], []
        read_ahead(f, offset, view.nbytes)
        try:
            for start in range(0, view.nbytes, chunk):
                end, done = min(start + chunk, view.nbytes), start
                while done < end:
                    n = f.readinto(view[done:end])
                    if not n:
                        raise ValueError("truncated")
                    done += n
                hashed += self._hash(view, [start], chunk, digest_of(header))
            if f.read(1):
                raise ValueError("longer than its header says")
        finally:
            concurrent.futures.wait(hashed)  # none still reads the buffer once this returns
        for i, (got, want) in enumerate(zip(hashed, digests)):
            if got.result() != want:
                raise ValueError(f"its bytes do not match their digest (chunk {i} of {len(digests)})")

    def _corrupt(self, key: bytes, path: Path, exc: Exception) -> NoReturn:
        """A file found not to be what was written: forgotten, removed, TierCorrupt."""
        self._discard(key, path)
        raise TierCorrupt(f"tier file {path.name} refused: {exc}") from None

    def _discard(self, key: bytes, path: Path) -> None:
        """Forgets ``key`` (if held) and removes its file: it is not what was written."""
        if key in self._sizes:
            self._forget(key)
        path.unlink(missing_ok=True)

    def remove(self, key: bytes) -> bool:
        """Drops the segment (its file too); False if the tier did not hold it."""
        with self._mutex:
            self._check_open()
            return self._remove_key(key)

    def _check_open(self) -> None:
        if self._lock.closed:
            raise ConfigError(f"the tier on {self.path} is closed")

    def _remove_key(self, key: bytes) -> bool:
        if key not in self._sizes:
            return False
        self._forget(key)
        self._file(key).unlink(missing_ok=True)
        return True

    def _forget(self, key: bytes) -> None:
        self.used_bytes -= self._sizes.pop(key)
        self._meta.pop(key, None)

    def _evict_one(self) -> bytes:
        key = next(iter(self._sizes))
        self._remove_key(key)
        self.evictions += 1
        return key

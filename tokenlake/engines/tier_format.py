"""The disk tier's file format (:mod:`tokenlake.engines.tier_files`): a magic line, the
length of a msgpack header, the header (the key, the pool layout, the bytes' length,
their digests and the caller's meta) and the bytes; how a header is read and checked,
and how a file's bytes are read and checked against one digest of them all."""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct

import msgpack
import xxhash

MAGIC = b"TLTIER1\n"
LEN = struct.Struct("<I")
#: Header fields every file has (and either ``chunk`` and ``digests``, or, written
#: before chunks, one ``digest``).
FIELDS = ("key", "layout", "nbytes")
#: Bytes a file written with one digest is read and hashed at a time.
READ_CHUNK = 4 << 20
#: Digests a file has at most (a writer makes its chunks larger beyond; a header with
#: more is refused).
MAX_CHUNKS = 4096


#: The digest new files are written with (header ``hash``). A file without ``hash`` was
#: written with blake2b-128, and is still read.
HASH = "xxh3-128"
_DIGESTS = {
    "xxh3-128": xxhash.xxh3_128_hexdigest,
    "blake2b-128": lambda data: hashlib.blake2b(data, digest_size=16).hexdigest(),
}


def digest(data, algo: str = HASH) -> str:
    """The digest of ``data`` kept in a header, by ``algo`` (hex): XXH3 for new files
    (checks against damage, ten times blake2b's speed: a promotion hashes every byte on
    the CPU beside the model), blake2b for files written before it."""
    return _DIGESTS[algo](data)


def digest_of(header: dict) -> str:
    """The digest ``algo`` a file's chunks were hashed with."""
    return header.get("hash", "blake2b-128")


def short(value) -> str:
    return repr(value)[:40]


def read_checked(f, offset: int, view: memoryview, digest: str) -> None:
    """Reads an open file's bytes from ``offset`` into ``view`` (all of them: ValueError
    if there are fewer or more), hashing each chunk once it is in; ValueError if they do
    not match ``digest``."""
    read_ahead(f, offset, view.nbytes)
    h = hashlib.blake2b(digest_size=16)
    done = 0
    while done < view.nbytes:
        n = f.readinto(view[done:done + READ_CHUNK])
        if not n:
            raise ValueError("truncated")
        h.update(view[done:done + n])
        done += n
    if f.read(1):
        raise ValueError("longer than its header says")
    if h.hexdigest() != digest:
        raise ValueError("its bytes do not match their digest")


def read_ahead(f, offset: int, nbytes: int) -> None:
    """Asks the disk for ``nbytes`` of an open file from ``offset`` at once (the whole
    file in flight while its chunks are hashed); advice only: nothing where it is not
    taken (a pipe, a file system without it)."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(f.fileno(), offset, nbytes, os.POSIX_FADV_WILLNEED)


def read_header(f) -> tuple[dict, int]:
    """The header of an open tier file and the offset of its bytes; ValueError if the
    file does not start like one."""
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a tier file")
    raw = f.read(LEN.size)
    if len(raw) != LEN.size:
        raise ValueError("truncated header")
    (n,) = LEN.unpack(raw)
    packed = f.read(n)
    if len(packed) != n:
        raise ValueError("truncated header")
    try:
        header = msgpack.unpackb(packed)
    except Exception as exc:  # noqa: BLE001 - any malformed header is a refusal
        raise ValueError(f"unreadable header ({type(exc).__name__})") from None
    if not isinstance(header, dict) or any(k not in header for k in FIELDS):
        raise ValueError("header without its fields")
    h, chunked = header, "digests" in header
    if not (isinstance(h["key"], str) and type(h["nbytes"]) is int and h["nbytes"] >= 0 and (
            isinstance(h.get("digest"), str) if not chunked else type(h.get("chunk")) is int
            and h["chunk"] > 0 and isinstance(h["digests"], list) and all(isinstance(d, str) for d in h["digests"]))):
        raise ValueError("header with fields missing or of the wrong type")
    if not isinstance(h.get("hash", "blake2b-128"), str) or h.get("hash", "blake2b-128") not in _DIGESTS:
        raise ValueError(f"a digest this reader does not know ({short(h['hash'])})")
    if chunked and not len(h["digests"]) == -(-h["nbytes"] // h["chunk"]) <= MAX_CHUNKS:
        raise ValueError(f"{len(h['digests'])} digests for {h['nbytes']} bytes in chunks of {h['chunk']}")
    return header, len(MAGIC) + LEN.size + n

"""Segments and their keys (docs/design.md §4).

Token ids are split into segments of ``C`` tokens. Segment ``i`` of a sequence has the
chained 128-bit key ``h_i = blake2b(h_{i-1} || tokens_i)`` where ``tokens_i`` are the
segment's token ids as little-endian int32 and ``h_{-1} = blake2b(namespace)``. The
namespace names the model and the KV layout, so two models never share a segment. The
key of a segment therefore identifies the whole prefix up to and including it, is the
same in every process and run (no use of Python's ``hash()``), and a key alone is
enough to walk the global prefix tree.

Only full segments have chained keys; the open tail of a sequence (fewer than ``C``
tokens) is private to its request until it fills. When the request finishes, its tail
stays in the pool as a leaf under :meth:`SegmentHasher.tail_key` (its own hash
personalisation): later prompts hit its leading pages, nothing chains after it.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tokenlake.core.errors import ConfigError

#: Bytes in a segment key.
KEY_BYTES = 16

SegmentKey = bytes
"""A 16-byte chained segment key."""

_LITTLE = sys.byteorder == "little"


def namespace_root(namespace: str) -> SegmentKey:
    """The chain's starting value ``h_{-1}`` for a namespace (model id + KV layout)."""
    if not namespace:
        raise ConfigError("namespace must be a non-empty string (model id and KV layout)")
    return hashlib.blake2b(namespace.encode("utf-8"), digest_size=KEY_BYTES).digest()


def token_bytes(token_ids: Sequence[int] | array | bytes | memoryview) -> bytes:
    """Token ids as little-endian int32 bytes (the hashed representation).

    Accepts a sequence of ints, an ``array('i')``, or bytes already in that form.
    Raises ``ValueError`` for ids that do not fit in int32.
    """
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        raw = bytes(token_ids)
        if len(raw) % 4:
            raise ValueError("token bytes must be a whole number of int32 values")
        return raw
    if isinstance(token_ids, array) and token_ids.typecode == "i" and token_ids.itemsize == 4:
        if _LITTLE:
            return token_ids.tobytes()
        swapped = array("i", token_ids)  # pragma: no cover - big-endian hosts
        swapped.byteswap()
        return swapped.tobytes()
    try:
        # struct unboxes a list of ints faster than array() and fixes the byte order.
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be int32 values: {exc}") from None


@dataclass(frozen=True)
class SegmentHasher:
    """Splits token ids into segments and computes their chained keys.

    Attributes:
        segment_tokens: ``C``, tokens per segment.
        namespace: model id + KV layout; keys of different namespaces never collide.
    """

    segment_tokens: int
    namespace: str

    def __post_init__(self) -> None:
        if not isinstance(self.segment_tokens, int) or self.segment_tokens < 1:
            raise ConfigError(f"segment_tokens must be a positive int, got {self.segment_tokens!r}")
        object.__setattr__(self, "_root", namespace_root(self.namespace))

    @property
    def root(self) -> SegmentKey:
        """``h_{-1}``: the parent key of every first segment."""
        return self._root  # type: ignore[attr-defined]

    def num_full(self, num_tokens: int) -> int:
        """Number of full segments in ``num_tokens`` tokens."""
        return num_tokens // self.segment_tokens

    def split(self, token_ids: Sequence[int]) -> list[Sequence[int]]:
        """The token ids cut into segments; the last one may be partial."""
        c = self.segment_tokens
        return [token_ids[i : i + c] for i in range(0, len(token_ids), c)]

    def iter_keys(
        self, token_ids: Sequence[int] | bytes, parent: SegmentKey | None = None
    ) -> Iterator[SegmentKey]:
        """Yields the key of every full segment of ``token_ids``, lazily.

        ``parent`` continues a chain: pass the key of the segment that precedes
        ``token_ids[0]`` (default: the namespace root, i.e. the sequence starts at 0).
        Lazy so that a prefix match can stop at the first miss without hashing the rest.
        """
        raw = token_bytes(token_ids)
        step = 4 * self.segment_tokens
        h = self.root if parent is None else parent
        blake = hashlib.blake2b
        view = memoryview(raw)
        for off in range(0, len(raw) - step + 1, step):
            hasher = blake(h, digest_size=KEY_BYTES)
            hasher.update(view[off : off + step])
            h = hasher.digest()
            yield h

    def tail_key(self, token_ids: Sequence[int] | bytes, parent: SegmentKey | None = None) -> SegmentKey:
        """The key of a finished request's *tail*: fewer than ``C`` tokens after the
        segment ``parent`` (``None``: at the start), kept in the pool for page hits.
        Hashed under its own personalisation, so no whole segment's key equals it."""
        raw = token_bytes(token_ids)
        hasher = hashlib.blake2b(self.root if parent is None else parent,
                                 digest_size=KEY_BYTES, person=b"tokenlake-tail")
        hasher.update(raw)
        return hasher.digest()

    def keys(
        self, token_ids: Sequence[int] | bytes, parent: SegmentKey | None = None
    ) -> list[SegmentKey]:
        """The keys of all full segments of ``token_ids`` (see :meth:`iter_keys`)."""
        return list(self.iter_keys(token_ids, parent))

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

A *cache salt* (a tenant's namespace, vLLM's ``cache_salt``) starts a sequence's chain
at :meth:`SegmentHasher.salt_root` instead of ``h_{-1}``: every key of a salted sequence
differs from the unsalted one's and from every other salt's, so tenants with different
salts never share a segment. No salt (``None`` or ``""``) keeps the keys above.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tokenlake.core.errors import ConfigError, PlanError

#: Bytes in a segment key.
KEY_BYTES = 16

#: Most characters a cache salt may have.
MAX_SALT_CHARS = 256

SegmentKey = bytes
"""A 16-byte chained segment key."""

_LITTLE = sys.byteorder == "little"


def namespace_root(namespace: str) -> SegmentKey:
    """The chain's starting value ``h_{-1}`` for a namespace (model id + KV layout)."""
    if not namespace:
        raise ConfigError("namespace must be a non-empty string (model id and KV layout)")
    return hashlib.blake2b(namespace.encode("utf-8"), digest_size=KEY_BYTES).digest()


def check_salt(salt: object) -> str | None:
    """``salt`` as a cache salt: ``None`` for no salt (``None`` or ``""``), else the
    string itself. Raises :class:`PlanError` for anything but a string of at most
    :data:`MAX_SALT_CHARS` characters that UTF-8 can encode."""
    if salt is None or salt == "":
        return None
    if type(salt) is not str:
        raise PlanError(f"a cache salt must be a string, got {type(salt).__name__}")
    if len(salt) > MAX_SALT_CHARS:
        raise PlanError(f"a cache salt has at most {MAX_SALT_CHARS} characters, got {len(salt)}")
    if not salt.isascii():
        try:
            salt.encode("utf-8")
        except UnicodeEncodeError:
            raise PlanError("a cache salt must be Unicode text (it holds a lone surrogate)") from None
    return salt


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

    def salt_root(self, salt: str | None) -> SegmentKey:
        """The chain's starting value for a sequence under cache salt ``salt``: the
        parent key of its first segment (``iter_keys(tokens, parent=salt_root(salt))``).
        A blake2b keyed with :attr:`root` over the salt's UTF-8 bytes, under its own
        personalisation, so it equals no segment key, no tail key and no other salt's
        root. No salt (``None`` or ``""``): :attr:`root` itself. Raises
        :class:`PlanError` for a salt :func:`check_salt` refuses."""
        salt = check_salt(salt)
        if salt is None:
            return self.root
        return hashlib.blake2b(salt.encode("utf-8"), digest_size=KEY_BYTES, key=self.root,
                               person=b"tokenlake-salt").digest()

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
        ``token_ids[0]`` (default: the namespace root, i.e. the sequence starts at 0;
        a salted sequence starts at :meth:`salt_root`).
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
        segment ``parent`` (``None``: at the start; a salt's root: at the start of a
        salted sequence), kept in the pool for page hits.
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

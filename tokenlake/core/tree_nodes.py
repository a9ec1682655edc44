"""The nodes of the global prefix tree and what a match returns (internal to
:mod:`tokenlake.core.prefix_tree`, which re-exports :class:`SegmentLocation` and
:class:`MatchResult`): a node's replicas, its children indexed by their token bytes, and
the search for the child sharing the most leading pages with a prompt (page hits,
docs/design.md §4).
"""

from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass

from tokenlake.core.segments import SegmentHasher, SegmentKey, token_bytes

_LITTLE = sys.byteorder == "little"


class Replica:
    __slots__ = ("instance", "slot", "ready", "last_access", "lru_entry")

    def __init__(self, instance: int, slot: int, ready: bool, now: float) -> None:
        self.instance = instance
        self.slot = slot
        self.ready = ready
        self.last_access = now
        self.lru_entry: tuple | None = None


class TreeNode:
    __slots__ = ("key", "parent", "index", "tokens", "kids", "bare", "order", "replicas",
                 "locs", "leases", "pins", "fast_kids", "tier", "tier_entry")

    def __init__(self, key: SegmentKey, parent: SegmentKey | None, index: int,
                 tokens: bytes | None = None) -> None:
        self.key = key
        self.parent = parent  # None under the unsalted root; a salted first segment's: its salt's root key
        self.index = index  # position of the segment in its sequence (0 = first)
        self.tokens = tokens  # the segment's token ids, encoded (TokenCodec); None: unknown
        # Children by their token bytes (what a match walks): None for a leaf, the child
        # itself while it is the only one (most nodes), a dict from two on. Children
        # inserted without tokens are kept by key in ``bare``.
        self.kids: TreeNode | dict[bytes, TreeNode] | None = None
        self.bare: dict[SegmentKey, TreeNode] | None = None
        # (tokens, key) of the children with tokens, sorted; only once there are two.
        self.order: list[tuple[bytes, SegmentKey]] | None = None
        self.replicas: list[Replica] = []  # at most one per instance, in creation order
        self.locs: tuple[SegmentLocation, ...] = ()  # ready replicas, as match returns them
        self.leases = 0
        self.pins = 0
        self.fast_kids = 0  # children with a replica (ready or pending): not only in the tier
        self.tier = None  # the instance whose disk tier holds a copy (core/tier.py), or None
        self.tier_entry: tuple | None = None  # its entry in the tier's LRU index

    @property
    def has_children(self) -> bool:
        return self.kids is not None or bool(self.bare)

    @property
    def tier_only(self) -> bool:
        """Held only in the disk tier: no replica in a slab, a copy in a tier."""
        return not self.replicas and self.tier is not None

    def n_children(self) -> int:
        kids = self.kids
        n = 0 if kids is None else 1 if type(kids) is TreeNode else len(kids)
        return n + (len(self.bare) if self.bare else 0)

    def token_children(self) -> list[TreeNode]:
        kids = self.kids
        if kids is None:
            return []
        return [kids] if type(kids) is TreeNode else list(kids.values())

    def child_nodes(self) -> list[TreeNode]:
        out = self.token_children()
        if self.bare:
            out.extend(self.bare.values())
        return out

    def add_child(self, node: TreeNode) -> None:
        """Indexes a new child: by its tokens (kept sorted from two on), else by key."""
        raw, kids = node.tokens, self.kids
        if raw is None:
            if self.bare is None:
                self.bare = {}
            self.bare[node.key] = node
        elif kids is None:
            self.kids = node
        elif type(kids) is TreeNode:
            self.kids = {kids.tokens: kids, raw: node}
            self.order = sorted(((kids.tokens, kids.key), (raw, node.key)))
        else:
            kids[raw] = node
            bisect.insort(self.order, (raw, node.key))

    def drop_child(self, node: TreeNode) -> None:
        """Forgets a child (a single one left is held directly again)."""
        kids = self.kids
        if node.tokens is None:
            if self.bare is not None and self.bare.pop(node.key, None) is not None and not self.bare:
                self.bare = None
        elif kids is node:
            self.kids = None
        elif type(kids) is dict and kids.get(node.tokens) is node:
            del kids[node.tokens]
            if len(kids) == 1:
                (self.kids,) = kids.values()
                self.order = None
            else:
                del self.order[bisect.bisect_left(self.order, (node.tokens, node.key))]

    def check_links(self, parent: TreeNode | None, nodes: dict[SegmentKey, TreeNode],
                    salted: bool = False) -> None:
        """Asserts this node's place under ``parent`` (None: it is a root; ``salted``:
        a salt's root, whose children name it by its key, where the unsalted root's name
        it ``None``), its children's links back and indices, its sorted children index
        and its cached ready replicas (for tests)."""
        if parent is not None:  # a node; ``nodes`` must hold its parent
            if self.tokens is None:
                assert parent.bare is not None and parent.bare.get(self.key) is self
            else:
                assert self in parent.token_children() and (
                    parent.kids is self or parent.kids.get(self.tokens) is self)
            want = tuple(SegmentLocation(r.instance, r.slot) for r in self.replicas if r.ready)
            assert self.locs == want, "cached ready replicas out of date"
            assert len({r.instance for r in self.replicas}) == len(self.replicas)
        own = self.key if parent is not None or salted else None
        for child in self.child_nodes():
            assert child.parent == own
            assert child.index == self.index + 1, "a child's index is not its parent's + 1"
            assert nodes.get(child.key) is child
        with_tokens = sorted((n.tokens, n.key) for n in self.token_children())
        if self.order is not None:
            assert self.order == with_tokens, "children's token order out of date"
            assert type(self.kids) is dict and len(self.kids) >= 2
        else:
            assert len(with_tokens) <= 1, "two children without a token order"

    def ready_instances(self) -> list[int]:
        return [r.instance for r in self.replicas if r.ready]

    def replica(self, instance: int) -> Replica | None:
        for r in self.replicas:
            if r.instance == instance:
                return r
        return None


@dataclass(frozen=True, slots=True)
class SegmentLocation:
    """Where one ready replica of a segment lives."""

    instance: int  # instance id
    slot: int  # slot number in that instance's slab


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a token sequence, exact to a page.

    Attributes:
        keys: keys of the matched whole segments, in sequence order.
        replicas: for each matched segment, its ready replicas.
        hit_tokens: tokens covered by the match (``len(keys) * C + partial_tokens``).
        partial_key: the segment after the whole ones whose leading ``partial_tokens``
            tokens (whole pages) equal the sequence's next tokens, or ``None``.
        partial_tokens: tokens of ``partial_key`` that match (0 without one).
        partial_replicas: the ready replicas of ``partial_key``.
        tier_keys: with a tier, the whole segments after ``keys`` held only in the
            tier (to promote before they are read; no partial hit is looked for then),
            then, where one starts with the sequence's next pages, that segment too
            (promoted, it gives the partial hit; ``tier_partial`` says so).
    """

    keys: tuple[SegmentKey, ...]
    replicas: tuple[tuple[SegmentLocation, ...], ...]
    hit_tokens: int
    partial_key: SegmentKey | None = None
    partial_tokens: int = 0
    partial_replicas: tuple[SegmentLocation, ...] = ()
    tier_keys: tuple[SegmentKey, ...] = ()
    tier_partial: bool = False

    @property
    def num_segments(self) -> int:
        return len(self.keys)

    @property
    def whole_tokens(self) -> int:
        """Tokens of the whole matched segments (the hit without its partial pages)."""
        return self.hit_tokens - self.partial_tokens




def common_pages(a: bytes, b: bytes, page_bytes: int, max_pages: int) -> int:
    """How many leading pages of ``page_bytes`` bytes ``a`` and ``b`` share (at most
    ``max_pages``): a binary search over prefix comparisons (each one a memcmp)."""
    lo, hi = 0, min(max_pages, len(a) // page_bytes, len(b) // page_bytes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        n = mid * page_bytes
        if a[:n] == b[:n]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def relocate(node: TreeNode) -> None:
    """Refreshes the node's cached tuple of ready replicas (what a match returns)."""
    node.locs = tuple(SegmentLocation(r.instance, r.slot) for r in node.replicas if r.ready)


def best_partial(pnode: TreeNode, seg: bytes, page_tokens: int, width: int, max_pages: int,
                 tier_only: bool = False) -> tuple[SegmentKey, int, tuple[SegmentLocation, ...]] | None:
    """The ready child of ``pnode`` (``tier_only``: the child held only in the tier)
    whose leading pages equal the most leading pages of ``seg`` (tokens encoded ``width``
    bytes each; at most ``max_pages``), as ``(key, tokens, ready replicas)``, or
    ``None``. In the sorted order of the children's tokens the children sharing most
    pages with ``seg`` lie next to its place, and fewer are shared the farther one goes;
    some of them may not be usable (pending, or not held only in the tier), so on each
    side the nearest usable child that shares a page is the candidate. Pages are
    compared exactly."""
    if pnode.order is not None:
        order, cands = pnode.order, []
        i = bisect.bisect_left(order, (seg,))
        for side in (range(i - 1, -1, -1), range(i, len(order))):
            for j in side:
                node = pnode.kids[order[j][0]]
                if not common_pages(seg, node.tokens, width * page_tokens, max_pages):
                    break  # nothing farther on this side shares a page either
                if node.tier_only if tier_only else node.locs:
                    cands.append(node)
                    break
    else:
        cands = pnode.token_children()
    best: tuple[SegmentKey, int, tuple[SegmentLocation, ...]] | None = None
    for node in cands:
        pages = common_pages(seg, node.tokens, width * page_tokens, max_pages)
        usable = node.tier_only if tier_only else node.locs
        if pages and usable and (best is None or pages * page_tokens > best[1]):
            best = (node.key, pages * page_tokens, node.locs)
    return best


def match_from(root: TreeNode, token_ids, max_tokens: int | None, hasher: SegmentHasher,
               codec: TokenCodec, page_tokens: int, nodes: dict[SegmentKey, TreeNode],
               tiered: bool) -> MatchResult:
    """:meth:`PrefixTree.match <tokenlake.core.prefix_tree.PrefixTree.match>` below
    ``root`` (``tiered``: the tree has a disk tier, report what follows in it)."""
    c = hasher.segment_tokens
    # Raw int32 bytes are a Sequence too: count (and cut) them in tokens of 4 bytes.
    width = 4 if isinstance(token_ids, (bytes, bytearray, memoryview)) else 1
    limit = len(token_ids) // width
    if max_tokens is not None:
        limit = min(limit, max_tokens)
    max_segments = limit // c
    keys: list[SegmentKey] = []
    where: list[tuple[SegmentLocation, ...]] = []
    if max_segments:
        # Walk the children by their token bytes (exact, no hashing); only children
        # inserted without tokens are looked up by their chained key.
        raw = token_bytes(token_ids[: max_segments * c * width])
        enc = codec.encode_prefix(raw)
        walk(root, enc, raw, c, codec.width, hasher, keys, where)
        if tiered and len(keys) < max_segments:
            tier: list[SegmentKey] = []  # then held only in the tier: to promote
            off, start = len(keys) * c, nodes[keys[-1]] if keys else root
            walk(start, enc[off * codec.width :], raw[off * 4 :], c, codec.width, hasher,
                 tier, [], tiered=True)
            if tier:
                nxt = token_ids[(off + len(tier) * c) * width : min(limit, off + (len(tier) + 1) * c) * width]
                part = partial_child(nodes[tier[-1]], nxt, codec, page_tokens, c, tier_only=True)
                tier += [part[0]] if part is not None else []
                return MatchResult(tuple(keys), tuple(where), off, tier_keys=tuple(tier),
                                   tier_partial=part is not None)
    whole = len(keys) * c
    if page_tokens < c and limit - whole >= page_tokens:
        nxt = token_ids[whole * width : min(limit, whole + c) * width]
        pnode = nodes[keys[-1]] if keys else root
        hit = partial_child(pnode, nxt, codec, page_tokens, c)
        if hit is not None:
            pkey, ptok, plocs = hit
            return MatchResult(tuple(keys), tuple(where), whole + ptok, pkey, ptok, plocs)
        if tiered and (hit := partial_child(pnode, nxt, codec, page_tokens, c, tier_only=True)):
            return MatchResult(tuple(keys), tuple(where), whole, tier_keys=(hit[0],), tier_partial=True)
    return MatchResult(tuple(keys), tuple(where), whole)


def partial_child(pnode: TreeNode | None, token_ids, codec: TokenCodec, page_tokens: int,
                  c: int, tier_only: bool = False) -> tuple[SegmentKey, int, tuple[SegmentLocation, ...]] | None:
    """:meth:`PrefixTree.partial <tokenlake.core.prefix_tree.PrefixTree.partial>` of
    the node ``pnode`` (``c``: tokens per segment; ``tier_only``: among the children
    held only in the tier)."""
    if pnode is None or pnode.kids is None:
        return None
    width = codec.width
    seg = codec.encode_prefix(token_bytes(token_ids))
    max_pages = min(len(seg) // width, c - 1) // page_tokens
    return best_partial(pnode, seg, page_tokens, width, max_pages, tier_only) if max_pages else None


def walk(root: TreeNode, enc: bytes, raw: bytes, c: int, width: int, hasher: SegmentHasher,
         keys: list[SegmentKey], where: list[tuple[SegmentLocation, ...]],
         tiered: bool = False) -> None:
    """Follows the whole ``c``-token segments of ``enc`` (tokens encoded ``width`` bytes
    each; ``raw``: the same as int32 bytes) down from ``root`` while each next segment is
    a ready child (``tiered``: a child held only in the disk tier), appending its key and
    ready replicas. Children are found by their token bytes (exact); only children
    inserted without tokens are looked up by their chained key."""
    node, step = root, width * c
    for off in range(0, len(enc) - step + 1, step):  # whole segments only
        seg = enc[off : off + step]
        kids = node.kids
        if type(kids) is TreeNode:
            child = kids if kids.tokens == seg else None
        else:
            child = kids.get(seg) if kids is not None else None
        if child is None:
            if node.bare is None:
                return
            i = off // width * 4
            child = node.bare.get(hasher.keys(raw[i : i + 4 * c], parent=node.key)[0])
            if child is None:
                return
        locs = child.locs
        if not (child.tier_only if tiered else locs):
            return
        keys.append(child.key)
        where.append(locs)
        node = child


class TokenCodec:
    """How a tree stores token ids: 2 bytes each (little-endian uint16) while every id
    it holds is below 65,536, 4 bytes (int32, the hashed form) otherwise. Either way a
    prefix of tokens is a prefix of bytes, which the sorted children and the page
    comparisons rely on. Narrowing is a numpy cast of the int32 bytes (no per-token
    Python work)."""

    def __init__(self) -> None:
        self.width = 2 if _LITTLE else 4

    def encode(self, raw: bytes) -> bytes | None:
        """``raw`` (int32 little-endian token bytes) in this codec; ``None`` when an id
        does not fit (only while narrow)."""
        if self.width == 4:
            return raw
        ids = _as_uint32(raw)
        return None if (ids > 0xFFFF).any() else ids.astype("<u2").tobytes()

    def encode_prefix(self, raw: bytes) -> bytes:
        """The longest leading run of ``raw``'s tokens that fits, encoded (ids that do
        not fit cannot be in a narrow tree, so a match stops before them)."""
        if self.width == 4:
            return raw
        ids = _as_uint32(raw)
        wide = ids > 0xFFFF
        if wide.any():
            ids = ids[: int(wide.argmax())]
        return ids.astype("<u2").tobytes()

    def widen(self, nodes: list[TreeNode]) -> None:
        """From 2 to 4 bytes per token: every node's tokens re-encoded and its children
        indexed again (an id of 65,536 or more arrived)."""
        kids = [n.token_children() for n in nodes]
        for n in nodes:
            if n.tokens is not None:
                n.tokens = self.decode(n.tokens)
        self.width = 4
        for n, children in zip(nodes, kids):
            n.kids = n.order = None
            for child in children:
                n.add_child(child)

    def decode(self, enc: bytes) -> bytes:
        """Encoded tokens back as int32 little-endian bytes (a numpy cast, as
        :meth:`encode`: it runs for every eviction)."""
        if self.width == 4:
            return enc
        import numpy as np

        return np.frombuffer(enc, dtype="<u2").astype("<i4").tobytes()


def _as_uint32(raw: bytes):
    """int32 little-endian token bytes as a numpy uint32 view (imported here: importing
    the control plane loads no numpy; a cast is a vectorised copy, no per-token Python)."""
    import numpy as np

    return np.frombuffer(raw, dtype="<u4")

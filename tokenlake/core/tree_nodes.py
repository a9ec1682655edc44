"""The nodes of the global prefix tree and what a match returns (internal to
:mod:`tokenlake.core.prefix_tree`, which re-exports :class:`SegmentLocation` and
:class:`MatchResult`): a node's replicas, its children indexed by their token bytes, and
the search for the child sharing the most leading pages with a prompt (page hits,
docs/design.md §4).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tokenlake.core.segments import SegmentHasher, SegmentKey


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
                 "locs", "leases", "pins")

    def __init__(self, key: SegmentKey, parent: SegmentKey | None, index: int,
                 tokens: bytes | None = None) -> None:
        self.key = key
        self.parent = parent
        self.index = index  # position of the segment in its sequence (0 = first)
        self.tokens = tokens  # the segment's token ids as int32 bytes (None: unknown)
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

    @property
    def has_children(self) -> bool:
        return self.kids is not None or bool(self.bare)

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
    """

    keys: tuple[SegmentKey, ...]
    replicas: tuple[tuple[SegmentLocation, ...], ...]
    hit_tokens: int
    partial_key: SegmentKey | None = None
    partial_tokens: int = 0
    partial_replicas: tuple[SegmentLocation, ...] = ()

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


def best_partial(pnode: TreeNode, seg: bytes, page_tokens: int, max_pages: int
                 ) -> tuple[SegmentKey, int, tuple[SegmentLocation, ...]] | None:
    """The ready child of ``pnode`` whose leading pages equal the most leading pages of
    ``seg`` (int32 bytes; at most ``max_pages``), as ``(key, tokens, ready replicas)``,
    or ``None``. In the sorted order of the children's tokens the best child is one of
    the two neighbours of ``seg``; the pages are compared exactly."""
    if pnode.order is not None:
        i = bisect.bisect_left(pnode.order, (seg,))
        cands = [pnode.kids[pnode.order[j][0]] for j in (i - 1, i) if 0 <= j < len(pnode.order)]
    else:
        cands = pnode.token_children()
    best: tuple[SegmentKey, int, tuple[SegmentLocation, ...]] | None = None
    for node in cands:
        pages = common_pages(seg, node.tokens, 4 * page_tokens, max_pages)
        if pages and node.locs and (best is None or pages * page_tokens > best[1]):
            best = (node.key, pages * page_tokens, node.locs)
    return best


def walk(root: TreeNode, raw: bytes, step: int, hasher: SegmentHasher,
         keys: list[SegmentKey], where: list[tuple[SegmentLocation, ...]]) -> None:
    """Follows ``raw`` (int32 token bytes, whole segments of ``step`` bytes) down from
    ``root`` while each next segment is a ready child, appending its key and ready
    replicas. Children are found by their token bytes (exact); only children inserted
    without tokens are looked up by their chained key."""
    node = root
    for off in range(0, len(raw), step):
        seg = raw[off : off + step]
        kids = node.kids
        if type(kids) is TreeNode:
            child = kids if kids.tokens == seg else None
        else:
            child = kids.get(seg) if kids is not None else None
        if child is None:
            if node.bare is None:
                return
            child = node.bare.get(hasher.keys(seg, parent=node.key)[0])
            if child is None:
                return
        locs = child.locs
        if not locs:
            return
        keys.append(child.key)
        where.append(locs)
        node = child

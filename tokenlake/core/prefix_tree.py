"""The global prefix tree of segments (docs/design.md §4, paper §3.2).

Nodes are full segments, keyed by their chained key (see :mod:`tokenlake.core.segments`), so
a key names a whole prefix and the tree is a dict plus parent/children links. Each node
has one or more *replicas* (instance, slot). A replica is *pending* until all its layers
are stored; a segment is visible to :meth:`PrefixTree.match` only once it has a ready
replica.

Hits are exact to a *page* (``page_tokens``, docs/design.md §4): a node keeps its
segment's token ids, and :meth:`PrefixTree.match` walks children by them, then returns
the child whose leading pages equal the prompt's next tokens (compared token for token;
chained keys only name whole segments). Node structures: :mod:`tokenlake.core.tree_nodes`.

Invariants kept here (and checked by :meth:`PrefixTree.check`):

* every non-root node's parent is in the tree (no orphaned suffix);
* a node with children, a pin or a lease is never removed;
* the LRU index holds exactly the replicas that may be evicted now: ready replicas of
  unpinned, unleased nodes that are either a leaf or have another ready replica; it is
  kept per instance (eviction at a segment's home picks that instance's oldest);
* a node with two or more children holds their token bytes sorted (children inserted
  without tokens take no part in page hits).

The tree is pure bookkeeping: which slot to take and what to evict is decided by
:class:`tokenlake.core.pool.CachePool`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

from sortedcontainers import SortedList

from tokenlake.core.errors import SegmentNotFound
from tokenlake.core.segments import SegmentHasher, SegmentKey, token_bytes
from tokenlake.core.tree_nodes import (
    MatchResult,
    Replica,
    SegmentLocation,
    TokenCodec,
    TreeNode,
    best_partial,
    relocate,
    walk,
)

__all__ = ["MatchResult", "PrefixTree", "SegmentLocation"]


class PrefixTree:
    """Global prefix tree with replicas, leases, pins and an LRU index of evictable replicas.

    Args:
        hasher: the segment hasher (gives ``C`` and the namespace of the keys).
        page_tokens: granularity of hits inside a segment (must divide ``C``; ``None``:
            ``C``, whole segments only).
    """

    def __init__(self, hasher: SegmentHasher, page_tokens: int | None = None) -> None:
        c = hasher.segment_tokens
        page = c if page_tokens is None else page_tokens
        if not isinstance(page, int) or page < 1 or c % page:
            raise ValueError(f"page_tokens={page_tokens!r} must be a positive divisor of C={c}")
        self.hasher = hasher
        self.page_tokens = page
        self._codec = TokenCodec()  # 2 bytes per token while every id fits
        self._nodes: dict[SegmentKey, TreeNode] = {}
        self._root = TreeNode(hasher.root, None, -1)  # virtual: its children are first segments
        # Per instance: (last_access, -index, seq, key, instance) of evictable replicas.
        self._lru: dict[int, SortedList] = {}
        self._seq = itertools.count()

    # ------------------------------------------------------------------ lookup
    @property
    def segment_tokens(self) -> int:
        return self.hasher.segment_tokens

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def is_ready(self, key: SegmentKey) -> bool:
        """True when ``key`` is in the tree with at least one ready replica."""
        node = self._nodes.get(key)
        return node is not None and bool(node.locs)

    def parent(self, key: SegmentKey) -> SegmentKey | None:
        return self._node(key).parent

    def index(self, key: SegmentKey) -> int:
        return self._node(key).index

    def children(self, key: SegmentKey | None) -> tuple[SegmentKey, ...]:
        """Children of ``key``; ``None`` names the (virtual) root."""
        node = self._root if key is None else self._node(key)
        return tuple(n.key for n in node.child_nodes())

    def replicas(self, key: SegmentKey, ready_only: bool = True) -> tuple[SegmentLocation, ...]:
        node = self._node(key)
        if ready_only and len(node.locs) <= 1:  # the common case: cached
            return node.locs
        return tuple(
            SegmentLocation(r.instance, r.slot)
            for r in sorted(node.replicas, key=lambda r: r.instance)
            if r.ready or not ready_only
        )

    def is_pinned(self, key: SegmentKey) -> bool:
        return self._node(key).pins > 0

    def lease_count(self, key: SegmentKey) -> int:
        return self._node(key).leases

    def last_access(self, key: SegmentKey, instance: int) -> float:
        """Last access time of the replica of ``key`` on ``instance`` (LRU order)."""
        rep = self._node(key).replica(instance)
        if rep is None:
            raise SegmentNotFound(f"segment {key.hex()} has no replica on instance {instance}")
        return rep.last_access

    def keys(self) -> Iterator[SegmentKey]:
        return iter(self._nodes)

    def match(self, token_ids: Sequence[int] | bytes, max_tokens: int | None = None) -> MatchResult:
        """Longest prefix of ``token_ids`` held by ready segments, exact to a page: the
        whole segments, then the leading pages of the next segment where a ready one
        shares them (see :meth:`partial`).

        Hashing is lazy and stops at the first miss. ``max_tokens`` caps the match
        (e.g. ``len(prompt) - 1`` so that at least one token is left to compute).
        """
        c = self.hasher.segment_tokens
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
            codec = self._codec
            walk(self._root, codec.encode_prefix(raw), raw, c, codec.width, self.hasher, keys, where)
        whole = len(keys) * c
        if self.page_tokens < c and limit - whole >= self.page_tokens:
            nxt = token_ids[whole * width : min(limit, whole + c) * width]
            hit = self.partial(keys[-1] if keys else None, nxt)
            if hit is not None:
                pkey, ptok, plocs = hit
                return MatchResult(tuple(keys), tuple(where), whole + ptok, pkey, ptok, plocs)
        return MatchResult(tuple(keys), tuple(where), whole)

    def partial(
        self, parent: SegmentKey | None, token_ids: Sequence[int] | bytes
    ) -> tuple[SegmentKey, int, tuple[SegmentLocation, ...]] | None:
        """The ready child of ``parent`` (``None``: the root) whose leading whole pages
        equal the most leading tokens of ``token_ids`` (at most ``C - 1`` of them count),
        as ``(key, tokens, ready replicas)``; ``None`` if no child shares a page.
        Tokens are compared exactly."""
        pnode = self._root if parent is None else self._nodes.get(parent)
        if pnode is None or pnode.kids is None:
            return None
        width = self._codec.width
        seg = self._codec.encode_prefix(token_bytes(token_ids))
        max_pages = min(len(seg) // width, self.hasher.segment_tokens - 1) // self.page_tokens
        return best_partial(pnode, seg, self.page_tokens, width, max_pages) if max_pages else None

    def tokens(self, key: SegmentKey) -> bytes | None:
        """The token ids of segment ``key`` as int32 bytes (``None`` if not recorded)."""
        enc = self._node(key).tokens
        return None if enc is None else self._codec.decode(enc)

    # ---------------------------------------------------------------- mutation
    def insert(self, key: SegmentKey, parent: SegmentKey | None, index: int,
               tokens: Sequence[int] | bytes | None = None) -> bool:
        """Adds a node without replicas; returns False if ``key`` was already there (dedup).

        ``parent`` must be in the tree (``None`` for a first segment, with ``index`` 0).
        ``tokens`` (the segment's ``C`` token ids) make the node a candidate for page
        hits; without them only whole-segment matches find it. Fewer than ``C`` tokens
        make it a *tail* (a finished request's open tail, under
        :meth:`~tokenlake.core.segments.SegmentHasher.tail_key`): a leaf for page hits
        only, which no whole key reaches and no segment follows.
        """
        if key in self._nodes:
            return False
        if parent is None:
            if index != 0:
                raise ValueError("a segment without parent must have index 0")
        elif parent not in self._nodes:
            raise SegmentNotFound(f"parent segment {parent.hex()} is not in the tree")
        elif self._nodes[parent].index != index - 1:
            raise ValueError("segment index must be its parent's index + 1")
        raw = None if tokens is None else token_bytes(tokens)
        if raw is not None and not 0 < len(raw) <= 4 * self.hasher.segment_tokens:
            raise ValueError(f"a segment has 1 to {self.hasher.segment_tokens} tokens, "
                             f"got {len(raw) // 4}")
        pnode = self._root if parent is None else self._nodes[parent]
        width = self._codec.width
        if pnode.tokens is not None and len(pnode.tokens) < width * self.hasher.segment_tokens:
            raise ValueError(f"segment {parent.hex()} is a tail: nothing follows it")
        enc = None if raw is None else self._codec.encode(raw)
        if raw is not None and enc is None:  # an id of 65,536 or more: 4 bytes from now on
            self._widen()
            enc = raw
        node = self._nodes[key] = TreeNode(key, parent, index, enc)
        first = not pnode.has_children
        pnode.add_child(node)
        if parent is not None and first:
            self._sync(pnode)  # its first child: no longer a leaf
        return True

    def _widen(self) -> None:
        """Every node's tokens from 2 to 4 bytes each, children indexed again."""
        self._codec.widen([self._root, *self._nodes.values()])

    def add_replica(
        self, key: SegmentKey, instance: int, slot: int, now: float, ready: bool = False
    ) -> None:
        """Records that ``slot`` on ``instance`` holds (or will hold) segment ``key``."""
        node = self._node(key)
        if node.replica(instance) is not None:
            raise ValueError(f"segment {key.hex()} already has a replica on instance {instance}")
        node.replicas.append(Replica(instance, slot, ready, now))
        self._sync(node)
        if ready:
            relocate(node)

    def set_ready(self, key: SegmentKey, instance: int, now: float) -> None:
        """Marks a pending replica as stored in all layers; the segment becomes matchable."""
        node = self._node(key)
        rep = node.replica(instance)
        if rep is None:
            raise SegmentNotFound(f"segment {key.hex()} has no replica on instance {instance}")
        rep.ready = True
        rep.last_access = now
        if rep.lru_entry is not None:  # already ready and indexed: re-file at the new time
            self._lru[rep.instance].remove(rep.lru_entry)
            rep.lru_entry = None
        self._sync(node)
        relocate(node)

    def touch(self, key: SegmentKey, instance: int, now: float) -> None:
        """Records an access of one replica at time ``now`` (for LRU)."""
        node = self._node(key)
        rep = node.replica(instance)
        if rep is None:
            raise SegmentNotFound(f"segment {key.hex()} has no replica on instance {instance}")
        rep.last_access = max(rep.last_access, now)
        if rep.lru_entry is not None:
            self._lru[rep.instance].remove(rep.lru_entry)
            rep.lru_entry = self._entry(node, rep)
            self._lru.setdefault(rep.instance, SortedList()).add(rep.lru_entry)

    def remove_replica(self, key: SegmentKey, instance: int) -> int:
        """Drops one replica and returns its slot; the node goes when its last replica goes.

        Removing the last replica of a node with children, a pin or a lease raises
        ``ValueError``: that would orphan a suffix or pull data from under a plan.
        """
        node = self._node(key)
        rep = node.replica(instance)
        if rep is None:
            raise SegmentNotFound(f"segment {key.hex()} has no replica on instance {instance}")
        if len(node.replicas) == 1 and (node.has_children or node.pins or node.leases):
            raise ValueError(f"segment {key.hex()} is pinned, leased or has children")
        if rep.lru_entry is not None:
            self._lru[rep.instance].remove(rep.lru_entry)
        node.replicas.remove(rep)
        if node.replicas:
            self._sync(node)
            relocate(node)
        else:
            self._drop_node(node)
        return rep.slot

    def remove_subtree(self, key: SegmentKey) -> list[tuple[SegmentKey, int, int]]:
        """Removes ``key`` and all its descendants regardless of pins and leases.

        Used when an instance fails. Returns ``(key, instance, slot)`` of every replica
        that was dropped so the caller can release the slots.
        """
        dropped: list[tuple[SegmentKey, int, int]] = []
        stack = [key]
        order: list[TreeNode] = []
        while stack:
            node = self._nodes[stack.pop()]
            order.append(node)
            stack.extend(n.key for n in node.child_nodes())
        for node in reversed(order):  # leaves first
            for rep in node.replicas:
                if rep.lru_entry is not None:
                    self._lru[rep.instance].remove(rep.lru_entry)
                dropped.append((node.key, rep.instance, rep.slot))
            node.replicas.clear()
            node.kids = node.bare = node.order = None
            node.locs = ()
            node.pins = node.leases = 0
            self._drop_node(node)
        return dropped

    # ------------------------------------------------------------ pins/leases
    def pin(self, keys: Iterable[SegmentKey]) -> None:
        """Pins segments: they are never evicted until unpinned (counted)."""
        self._adjust(keys, "pins", +1)

    def unpin(self, keys: Iterable[SegmentKey]) -> None:
        self._adjust(keys, "pins", -1)

    def lease(self, keys: Iterable[SegmentKey]) -> None:
        """Marks segments as referenced by an in-flight plan (counted)."""
        self._adjust(keys, "leases", +1)

    def unlease(self, keys: Iterable[SegmentKey], missing_ok: bool = False) -> None:
        """Releases leases; with ``missing_ok`` keys already removed (failures) are skipped."""
        if missing_ok:
            keys = [k for k in keys if k in self._nodes]
        self._adjust(keys, "leases", -1)

    # -------------------------------------------------------------------- LRU
    def lru_victim(self, instance: int | tuple[int, ...] | None = None
                   ) -> tuple[SegmentKey, int] | None:
        """The least recently used evictable replica as ``(key, instance)`` (on
        ``instance`` only, or on those instances, if given), or ``None``."""
        if isinstance(instance, int):
            lru = self._lru.get(instance)
            return (lru[0][3], lru[0][4]) if lru else None
        pools = self._lru.values() if instance is None else (self._lru.get(i) for i in instance)
        firsts = [lru[0] for lru in pools if lru]
        if not firsts:
            return None
        entry = min(firsts)
        return entry[3], entry[4]

    def evictable_count(self) -> int:
        """Evictable replicas, over every instance."""
        return sum(len(lru) for lru in self._lru.values())

    # -------------------------------------------------------------- internals
    def _node(self, key: SegmentKey) -> TreeNode:
        try:
            return self._nodes[key]
        except KeyError:
            raise SegmentNotFound(f"segment {bytes(key).hex()} is not in the tree") from None

    def _adjust(self, keys: Iterable[SegmentKey], field: str, delta: int) -> None:
        nodes = [self._node(k) for k in keys]  # validate all before changing any
        if delta < 0:
            need: dict[SegmentKey, int] = {}
            for n in nodes:
                need[n.key] = need.get(n.key, 0) + 1
            for n in nodes:
                if getattr(n, field) < need[n.key]:
                    raise ValueError(f"segment {n.key.hex()} has no {field[:-1]} to release")
        for n in nodes:
            old = getattr(n, field)
            setattr(n, field, old + delta)
            if old == 0 or old + delta == 0:  # evictability changes only at zero
                self._sync(n)

    def _entry(self, node: TreeNode, rep: Replica) -> tuple:
        return (rep.last_access, -node.index, next(self._seq), node.key, rep.instance)

    def _evictable(self, node: TreeNode) -> bool:
        if node.pins or node.leases:
            return False
        ready = 0
        for r in node.replicas:
            ready += r.ready
        return ready > 1 or (ready == 1 and not node.has_children)

    def _sync(self, node: TreeNode) -> None:
        """Makes the LRU index agree with the node's current state."""
        ok = self._evictable(node)
        for rep in node.replicas:
            want = ok and rep.ready
            if want and rep.lru_entry is None:
                rep.lru_entry = self._entry(node, rep)
                self._lru.setdefault(rep.instance, SortedList()).add(rep.lru_entry)
            elif not want and rep.lru_entry is not None:
                self._lru[rep.instance].remove(rep.lru_entry)
                rep.lru_entry = None

    def _drop_node(self, node: TreeNode) -> None:
        del self._nodes[node.key]
        node.locs = ()
        pnode = self._root if node.parent is None else self._nodes.get(node.parent)
        if pnode is None:
            return
        pnode.drop_child(node)
        if pnode is not self._root and not pnode.has_children:
            self._sync(pnode)  # a leaf again

    def check(self) -> None:
        """Asserts the invariants listed in the module docstring (for tests)."""
        entries = [e for lru in self._lru.values() for e in lru]
        in_lru = {(e[3], e[4]) for e in entries}
        assert len(in_lru) == len(entries)
        assert all(e[4] == inst for inst, lru in self._lru.items() for e in lru)
        for key, node in self._nodes.items():
            assert node.parent is None or node.parent in self._nodes, "orphaned suffix"
            node.check_links(self._root if node.parent is None else self._nodes[node.parent],
                             self._nodes)
            ok = self._evictable(node)
            assert len({r.instance for r in node.replicas}) == len(node.replicas)
            for rep in node.replicas:
                inst = rep.instance
                assert ((key, inst) in in_lru) == (ok and rep.ready), "LRU index out of date"
                if rep.lru_entry is not None:
                    assert rep.lru_entry[:2] == (rep.last_access, -node.index), "stale LRU entry"
        assert all(self._nodes.get(n.key) is n for n in self._root.child_nodes())
        self._root.check_links(None, self._nodes)

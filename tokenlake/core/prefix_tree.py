"""The global prefix tree of segments (docs/design.md §4, paper §3.2).

Nodes are full segments, keyed by their chained key (see :mod:`tokenlake.core.segments`), so
a key names a whole prefix and the tree is a dict plus parent/children links. Each node
has one or more *replicas* (instance, slot). A replica is *pending* until all its layers
are stored; a segment is visible to :meth:`PrefixTree.match` only once it has a ready
replica.

Hits are exact to a *page* (``page_tokens``, docs/design.md §4): a node keeps its
segment's token ids; :meth:`PrefixTree.match` walks children by them, then returns the
child whose leading pages equal the prompt's next tokens. Sequences under a *cache salt*
(docs/design.md §4) hang under their own virtual root, named by
:meth:`~tokenlake.core.segments.SegmentHasher.salt_root` (a salted first segment's
parent; an unsalted one's is ``None``), and every match walks from the root of its
salt, so none crosses salts. Node structures: :mod:`tokenlake.core.tree_nodes`.

With a disk tier (:mod:`tokenlake.core.tier`) a node whose last replica leaves the slabs
stays while a tier holds a copy: *held only in the tier*, a match does not read it but
reports it (``MatchResult.tier_keys``) for promotion. Invariants: :mod:`tokenlake.core.tree_check`.

The tree is pure bookkeeping: which slot to take and what to evict is decided by
:class:`tokenlake.core.pool.CachePool`; the LRU index is :mod:`tokenlake.core.tree_lru`;
a :attr:`PrefixTree.journal` hears of every ready replica, for a restart
(:mod:`tokenlake.core.slot_records`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from tokenlake.core.errors import SegmentNotFound
from tokenlake.core.segments import SegmentHasher, SegmentKey, check_salt, token_bytes
from tokenlake.core.slot_records import SlotJournal
from tokenlake.core.tree_check import check_tree
from tokenlake.core.tree_lru import EvictionIndex
from tokenlake.core.tree_nodes import (
    MatchResult,
    Replica,
    SegmentLocation,
    TokenCodec,
    TreeNode,
    match_from,
    partial_child,
    relocate,
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
        # The virtual roots of salted sequences, by their key (salt_root), while they
        # have children: created by the first insert under a salt, dropped with its last.
        self._roots: dict[SegmentKey, TreeNode] = {}
        self._lru = EvictionIndex()  # the evictable replicas, per instance (tree_lru.py)
        self.journal: SlotJournal | None = None  # told of every ready replica (slot_records.py)
        # With a disk tier (core/tier.py): told of every node dropped with a tier copy;
        # set, a match also reports the segments after its hit held only in the tier.
        self.tier_dropped: Callable[[TreeNode], None] | None = None

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
        """Children of ``key``: ``None``: of the unsalted root; a salt's :meth:`root_key`:
        of that salt's root; else of a node (:class:`SegmentNotFound` if not there)."""
        node = self._root if key is None else self._roots.get(key) or self._node(key)
        return tuple(n.key for n in node.child_nodes())

    def root_key(self, salt: str | None) -> SegmentKey | None:
        """The parent key of a first segment under cache salt ``salt``: ``None`` without
        a salt (``None`` or ``""``), else :meth:`SegmentHasher.salt_root`. Raises
        :class:`~tokenlake.core.errors.PlanError` for a salt that is not a string of at
        most 256 characters."""
        salt = check_salt(salt)
        return None if salt is None else self.hasher.salt_root(salt)

    def roots(self) -> tuple[SegmentKey | None, ...]:
        """The virtual roots: ``None`` (unsalted, always there), then the key of every
        salt's root that has a segment under it."""
        return (None, *self._roots)

    def first_segments(self) -> tuple[SegmentKey, ...]:
        """The first segments of every sequence, under every root (salted or not)."""
        return tuple(n.key for root in (self._root, *self._roots.values())
                     for n in root.child_nodes())

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
        return self._replica(key, instance)[1].last_access

    def keys(self) -> Iterator[SegmentKey]:
        return iter(self._nodes)

    def match(self, token_ids: Sequence[int] | bytes, max_tokens: int | None = None,
              salt: str | None = None) -> MatchResult:
        """Longest prefix of ``token_ids`` held by ready segments, exact to a page: the
        whole segments, then the leading pages of the next segment where a ready one
        shares them (see :meth:`partial`). Hashing is lazy and stops at the first miss.
        ``max_tokens`` caps the match (``len(prompt) - 1`` leaves a token to compute).
        ``salt``: the cache salt the sequence was stored under (``None`` or ``""``:
        none); only its segments match (:class:`~tokenlake.core.errors.PlanError` for a
        salt :meth:`root_key` refuses).
        """
        root = self._root if salt is None else self._salt_root(salt)
        if root is None:  # nothing stored under this salt
            return MatchResult((), (), 0)
        return match_from(root, token_ids, max_tokens, self.hasher, self._codec,
                          self.page_tokens, self._nodes, self.tier_dropped is not None)

    def partial(
        self, parent: SegmentKey | None, token_ids: Sequence[int] | bytes, tier_only: bool = False
    ) -> tuple[SegmentKey, int, tuple[SegmentLocation, ...]] | None:
        """The ready child of ``parent`` (``None``: the unsalted root; a salt's root
        key: that salt's root; ``tier_only``: the child held only in the tier) whose
        leading whole pages equal the most leading tokens of ``token_ids`` (at most
        ``C - 1`` of them count), as ``(key, tokens, ready replicas)``; ``None`` if no
        child shares a page. Tokens are compared exactly."""
        pnode = self._root if parent is None else self._roots.get(parent) or self._nodes.get(parent)
        return partial_child(pnode, token_ids, self._codec, self.page_tokens, self.segment_tokens, tier_only)

    def tokens(self, key: SegmentKey) -> bytes | None:
        """The token ids of segment ``key`` as int32 bytes (``None`` if not recorded)."""
        enc = self._node(key).tokens
        return None if enc is None else self._codec.decode(enc)

    # ---------------------------------------------------------------- mutation
    def insert(self, key: SegmentKey, parent: SegmentKey | None, index: int,
               tokens: Sequence[int] | bytes | None = None) -> bool:
        """Adds a node without replicas; returns False if ``key`` was already there (dedup).

        ``parent`` must be in the tree, or be a root for a first segment (``index`` 0):
        ``None``, or a salt's :meth:`root_key` (see :meth:`check_parent`). ``tokens``
        (the segment's ``C`` token ids) make the node a candidate for page hits; fewer
        than ``C`` make it a *tail* (a finished request's open tail, under
        :meth:`~tokenlake.core.segments.SegmentHasher.tail_key`): a leaf for page hits
        only, which no whole key reaches and no segment follows.
        """
        if key in self._nodes:
            return False
        pnode = self._parent_node(parent, index)
        raw = None if tokens is None else token_bytes(tokens)
        if raw is not None and not 0 < len(raw) <= 4 * self.hasher.segment_tokens:
            raise ValueError(f"a segment has 1 to {self.hasher.segment_tokens} tokens, "
                             f"got {len(raw) // 4}")
        width = self._codec.width
        if pnode.tokens is not None and len(pnode.tokens) < width * self.hasher.segment_tokens:
            raise ValueError(f"segment {parent.hex()} is a tail: nothing follows it")
        enc = None if raw is None else self._codec.encode(raw)
        if raw is not None and enc is None:  # an id of 65,536 or more: 4 bytes from now on
            # every node's tokens from 2 to 4 bytes each, children indexed again
            self._codec.widen([self._root, *self._roots.values(), *self._nodes.values()])
            enc = raw
        node = self._nodes[key] = TreeNode(key, parent, index, enc)
        first = not pnode.has_children
        pnode.add_child(node)
        if first and pnode.index >= 0:
            self._lru.sync(pnode)  # its first child: no longer a leaf
        elif first and pnode is not self._root:
            self._roots[parent] = pnode  # the first segment under this salt
        return True

    def check_parent(self, parent: SegmentKey | None, index: int) -> None:
        """Raises unless a segment at ``index`` may follow ``parent``: a first segment
        (``index`` 0) follows a root (``None``, or a salt's :meth:`root_key`, which names
        no segment), any other segment the segment at ``index - 1``, in the tree.
        ``ValueError`` for a wrong index, :class:`SegmentNotFound` for a missing parent."""
        self._parent_node(parent, index)

    def _parent_node(self, parent: SegmentKey | None, index: int) -> TreeNode:
        """The node a segment at ``index`` hangs under (see :meth:`check_parent`); a
        salt's root without segments yet is made, not registered (``insert`` does)."""
        if parent is None:
            if index != 0:
                raise ValueError("a segment without parent must have index 0")
            return self._root
        pnode = self._nodes.get(parent)
        if pnode is None:
            if index != 0:
                raise SegmentNotFound(f"parent segment {parent.hex()} is not in the tree")
            if parent == self.hasher.root:
                raise ValueError("the unsalted root is named None, not by its key")
            return self._roots.get(parent) or TreeNode(parent, None, -1)
        if pnode.index != index - 1:
            raise ValueError("segment index must be its parent's index + 1")
        return pnode

    def add_replica(
        self, key: SegmentKey, instance: int, slot: int, now: float, ready: bool = False
    ) -> None:
        """Records that ``slot`` on ``instance`` holds (or will hold) segment ``key``."""
        node = self._node(key)
        if node.replica(instance) is not None:
            raise ValueError(f"segment {key.hex()} already has a replica on instance {instance}")
        node.replicas.append(Replica(instance, slot, ready, now))
        if len(node.replicas) == 1:
            self._fast_changed(node, +1)
        self._lru.sync(node)
        if ready:
            relocate(node)
            self._seal(node, instance, slot, now)

    def set_ready(self, key: SegmentKey, instance: int, now: float) -> None:
        """Marks a pending replica as stored in all layers; the segment becomes matchable."""
        node, rep = self._replica(key, instance)
        rep.ready = True
        rep.last_access = now
        self._lru.drop(rep)  # already ready and indexed: filed again at the new time
        self._lru.sync(node)
        relocate(node)
        self._seal(node, instance, rep.slot, now)

    def touch(self, key: SegmentKey, instance: int, now: float) -> None:
        """Records an access of one replica at time ``now`` (for LRU)."""
        node, rep = self._replica(key, instance)
        rep.last_access = max(rep.last_access, now)
        self._lru.refile(node, rep)
        if self.journal is not None and rep.ready:
            self.journal.touched(instance, rep.slot, rep.last_access)

    def remove_replica(self, key: SegmentKey, instance: int) -> int:
        """Drops one replica and returns its slot. A node keeps its last replica while
        it is pinned, leased or has a child in a slab (``ValueError``); without it, a
        node with a tier copy stays, held only in the tier, and any other goes, with its
        children held only in the tier."""
        node, rep = self._replica(key, instance)
        if len(node.replicas) == 1 and (node.fast_kids or node.pins or node.leases):
            raise ValueError(f"segment {key.hex()} is pinned, leased or has children")
        self._lru.drop(rep)
        node.replicas.remove(rep)
        if self.journal is not None:
            self.journal.cleared(instance, rep.slot)
        if node.replicas:
            self._lru.sync(node)
        else:
            self._fast_changed(node, -1)
        relocate(node)
        if not node.replicas and node.tier is None:
            for child in node.child_nodes():  # held only in the tier: they go with it
                self.remove_subtree(child.key)
            self._drop_node(node)
        return rep.slot

    def remove_subtree(self, key: SegmentKey) -> list[tuple[SegmentKey, int, int]]:
        """Removes ``key`` and all its descendants regardless of pins and leases (an
        instance failed); returns ``(key, instance, slot)`` of every replica dropped."""
        dropped: list[tuple[SegmentKey, int, int]] = []
        stack = [key]
        order: list[TreeNode] = []
        while stack:
            node = self._nodes[stack.pop()]
            order.append(node)
            stack.extend(n.key for n in node.child_nodes())
        if order[0].replicas:
            self._fast_changed(order[0], -1)
        for node in reversed(order):  # leaves first
            for rep in node.replicas:
                self._lru.drop(rep)
                dropped.append((node.key, rep.instance, rep.slot))
                if self.journal is not None:
                    self.journal.cleared(rep.instance, rep.slot)
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
        return self._lru.victim(instance)

    def evictable_count(self) -> int:
        """Evictable replicas, over every instance."""
        return len(self._lru)

    # -------------------------------------------------------------- internals
    def _salt_root(self, salt: str) -> TreeNode | None:
        """The root of ``salt``'s sequences (None while nothing is stored under it)."""
        key = self.root_key(salt)
        return self._root if key is None else self._roots.get(key)

    def _node(self, key: SegmentKey) -> TreeNode:
        try:
            return self._nodes[key]
        except KeyError:
            raise SegmentNotFound(f"segment {bytes(key).hex()} is not in the tree") from None

    def node(self, key: SegmentKey) -> TreeNode:
        """The node of ``key`` (for :mod:`tokenlake.core.tier`, which keeps its tier)."""
        return self._node(key)

    def _replica(self, key: SegmentKey, instance: int) -> tuple[TreeNode, Replica]:
        node = self._node(key)
        rep = node.replica(instance)
        if rep is None:
            raise SegmentNotFound(f"segment {key.hex()} has no replica on instance {instance}")
        return node, rep

    def _seal(self, node: TreeNode, instance: int, slot: int, now: float) -> None:
        if self.journal is not None:  # the record of a ready replica (slot_records.py)
            self.journal.sealed(instance, slot, node.key, node.parent, node.index,
                                node.tokens and self._codec.decode(node.tokens), now)

    def _adjust(self, keys: Iterable[SegmentKey], field: str, delta: int) -> None:
        nodes = [self._node(k) for k in keys]  # validate all before changing any
        self._lru.adjust(nodes, field, delta)

    def _parent_node_of(self, node: TreeNode) -> TreeNode | None:
        parent = node.parent
        return self._root if parent is None else self._nodes.get(parent) or self._roots.get(parent)

    def _fast_changed(self, node: TreeNode, delta: int) -> None:
        """``node`` got its first replica (``+1``) or lost its last (``-1``): its
        parent's count of children in a slab, and whether the parent may be evicted."""
        pnode = self._parent_node_of(node)
        if pnode is not None:
            pnode.fast_kids += delta
            if pnode.index >= 0 and pnode.fast_kids == (delta > 0):
                self._lru.sync(pnode)

    def _drop_node(self, node: TreeNode) -> None:
        del self._nodes[node.key]
        node.locs = ()
        if node.tier is not None and self.tier_dropped is not None:
            self.tier_dropped(node)
        parent = node.parent
        pnode = self._parent_node_of(node)
        if pnode is None:
            return
        pnode.drop_child(node)
        if pnode.has_children:
            return
        if pnode.index >= 0:
            self._lru.sync(pnode)  # a leaf again
        elif pnode is not self._root:
            del self._roots[parent]  # the last segment under its salt went

    def check(self) -> None:
        """Asserts the invariants listed in the module docstring (for tests)."""
        self._lru.check(self._nodes)
        check_tree(self._nodes, self._root, self._roots, self.hasher.root)

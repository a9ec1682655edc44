"""The eviction index of the prefix tree (internal to :mod:`tokenlake.core.prefix_tree`):
per instance, the replicas that may be evicted now, least recently used first.

Mechanism only: the tree calls :meth:`EvictionIndex.sync` whenever a node's
evictability may have changed (and counts pins and leases through
:meth:`EvictionIndex.adjust`, which re-syncs a node when one crosses zero, as vLLM's block
pool does with its free queue and reference counts);
:class:`~tokenlake.core.pool.CachePool` decides what to evict. A replica is evictable
while it is ready and its node is unpinned, unleased, and either has no child in a slab
or has another ready replica (:func:`evictable`).

Entries are ``(last_access, -index, seq, key, instance)`` in one ``SortedList`` per
instance: the oldest first, ties deeper first, then in the order they were filed. A
replica keeps its own entry (``Replica.lru_entry``, ``None`` while not indexed), so
taking it out costs O(log n); the victim on one instance is found in O(1), the global
one in O(N).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from sortedcontainers import SortedList

from tokenlake.core.segments import SegmentKey
from tokenlake.core.tree_nodes import Replica, TreeNode


def evictable(node: TreeNode) -> bool:
    """True when ``node``'s ready replicas may be evicted: unpinned, unleased, and
    without a child in a slab or with another ready replica (evicting it orphans no
    suffix). With a disk tier (:mod:`tokenlake.core.tier`) children held only in the
    tier do not count: evicting the last replica leaves the node in the tier above them
    when it has a copy there, and takes them along when it has none."""
    if node.pins or node.leases:
        return False
    ready = 0
    for r in node.replicas:
        ready += r.ready
    return ready > 1 or (ready == 1 and not node.fast_kids)


class EvictionIndex:
    """The evictable replicas of a prefix tree, per instance, in LRU order."""

    def __init__(self) -> None:
        # Per instance: (last_access, -index, seq, key, instance) of evictable replicas.
        self._lru: dict[int, SortedList] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        """Evictable replicas, over every instance."""
        return sum(len(lru) for lru in self._lru.values())

    def victim(self, instance: int | tuple[int, ...] | None = None
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

    def sync(self, node: TreeNode) -> None:
        """Makes the index agree with the node's current state."""
        ok = evictable(node)
        for rep in node.replicas:
            want = ok and rep.ready
            if want and rep.lru_entry is None:
                self._file(node, rep)
            elif not want and rep.lru_entry is not None:
                self.drop(rep)

    def refile(self, node: TreeNode, rep: Replica) -> None:
        """Files an indexed replica of ``node`` again at its ``last_access`` (a replica
        not in the index stays out)."""
        if rep.lru_entry is not None:
            self._lru[rep.instance].remove(rep.lru_entry)
            self._file(node, rep)

    def drop(self, rep: Replica) -> None:
        """Takes ``rep`` out of the index, if it is in."""
        if rep.lru_entry is not None:
            self._lru[rep.instance].remove(rep.lru_entry)
            rep.lru_entry = None

    def adjust(self, nodes: Sequence[TreeNode], field: str, delta: int) -> None:
        """Adds ``delta`` to ``field`` (``"pins"`` or ``"leases"``: what keeps a node's
        replicas from eviction) of each of ``nodes`` (a node named twice counts twice),
        then re-syncs the nodes whose count crossed zero. All or none: releasing more than
        a node holds raises ``ValueError`` before any count changes."""
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
                self.sync(n)

    def _file(self, node: TreeNode, rep: Replica) -> None:
        rep.lru_entry = (rep.last_access, -node.index, next(self._seq), node.key, rep.instance)
        self._lru.setdefault(rep.instance, SortedList()).add(rep.lru_entry)

    def check(self, nodes: Mapping[SegmentKey, TreeNode]) -> None:
        """Asserts that the index holds exactly the evictable replicas of ``nodes`` (the
        tree's), each once, under its instance and at its current time and depth."""
        entries = [e for lru in self._lru.values() for e in lru]
        in_lru = {(e[3], e[4]) for e in entries}
        assert len(in_lru) == len(entries)
        assert all(e[4] == inst for inst, lru in self._lru.items() for e in lru)
        for key, node in nodes.items():
            ok = evictable(node)
            for rep in node.replicas:
                assert ((key, rep.instance) in in_lru) == (ok and rep.ready), \
                    "LRU index out of date"
                if rep.lru_entry is not None:
                    assert rep.lru_entry[:2] == (rep.last_access, -node.index), "stale LRU entry"

"""A comparable picture of a cache pool, for tests that check a pool is exactly as it was."""

from __future__ import annotations

from tokenlake.core.pool import CachePool
from tokenlake.core.prefix_tree import SegmentLocation


def pool_state(pool: CachePool) -> tuple:
    """Everything the pool knows, comparable with ``==``: nodes with their replicas'
    slots, readiness and LRU times, leases and pins; which slots are taken; private
    slots; the LRU victim's rank (last access, depth); the counters. Among replicas of
    equal rank the order is not part of it: a replica put back joins the end of its tie
    (see :meth:`CachePool.restore_evicted`)."""
    tree = pool.tree
    nodes = {
        k: (tree.parent(k), tree.index(k), tree.lease_count(k), tree.is_pinned(k),
            tuple((loc, loc in tree.replicas(k), tree.last_access(k, loc.instance))
                  for loc in tree.replicas(k, ready_only=False)))
        for k in tree.keys()
    }
    used = {(i, s) for i in pool.instances for s in range(pool.slots.capacity(i))
            if s not in pool.slots._free_set[i]}  # white-box: which slots are taken
    owners = {(i, s): pool.private_owner(SegmentLocation(i, s)) for i, s in used}
    private = {where: owner for where, owner in owners.items() if owner is not None}
    victim = tree.lru_victim()
    rank = victim and (tree.last_access(*victim), tree.index(victim[0]))
    return nodes, used, private, tree.evictable_count(), rank, pool.stats()


"""The records :class:`~tokenlake.core.pool.CachePool` returns (re-exported there):
evictions, placements, instance removals and the pool's counters (:func:`collect_stats`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenlake.core.prefix_tree import SegmentLocation
from tokenlake.core.segments import SegmentKey
from tokenlake.core.tier import TierStats


@dataclass(frozen=True)
class Eviction:
    """One replica the pool evicted to free its slot: enough to put it back exactly."""

    key: SegmentKey
    parent: SegmentKey | None  # its parent in the tree (a first segment's: None, or its salt's root key)
    index: int  # the segment's position in its sequence
    instance: int
    slot: int  # the freed slot; its data is intact until the slot is written again
    last_access: float  # the replica's LRU time (seconds of the pool's clock)
    tokens: bytes | None = None  # the segment's token ids (int32 bytes), if recorded


@dataclass(frozen=True)
class Placement:
    """Where :meth:`CachePool.place` or :meth:`CachePool.allocate_private` put something."""

    location: SegmentLocation
    created: bool  # False: the segment was already cached (dedup), nothing was taken
    evicted: Eviction | None = None  # the replica evicted to free ``location``, if any


@dataclass(frozen=True)
class InstanceRemoval:
    """What leaving the pool cost: segments gone from the tree and open tails lost."""

    instance: int
    removed_keys: tuple[SegmentKey, ...]  # segments no longer in the tree at all
    lost_private: tuple[str, ...]  # owners of private slots on the instance


@dataclass(frozen=True)
class PoolStats:
    """Counters of the pool (all counts are segments unless said otherwise)."""

    segments: int  # nodes in the global prefix tree
    replicas: int  # replicas of those nodes (>= segments)
    pinned: int  # nodes with a pin
    slots_used: Mapping[int, int] = field(default_factory=dict)  # per instance, incl. private
    slots_capacity: Mapping[int, int] = field(default_factory=dict)
    private_slots: int = 0  # open tails of running requests
    dedup_segments: int = 0  # inserts that found the segment already there
    evictions: int = 0  # replicas evicted to make room
    placed: int = 0  # new segments placed by hash (place()) and stored
    placed_at_home: int = 0  # ... of which on their hash home
    replications: int = 0  # replicas created by rebalancing
    reads: Mapping[int, int] = field(default_factory=dict)  # cumulative segment reads per instance
    tier: TierStats | None = None  # the disk tiers' counters (None: no tier)


def collect_stats(pool) -> PoolStats:
    """The counters of ``pool`` now (:meth:`CachePool.stats <tokenlake.core.pool.CachePool.stats>`)."""
    tree = pool.tree
    replicas = pinned = 0
    reads = pool.window.total_instance_accesses(pool.clock())
    for key in tree.keys():
        replicas += len(tree.replicas(key, ready_only=False))
        pinned += tree.is_pinned(key)
    instances = pool.instances
    return PoolStats(
        segments=len(tree),
        replicas=replicas,
        pinned=pinned,
        slots_used={i: pool.slots.used(i) for i in instances},
        slots_capacity={i: pool.slots.capacity(i) for i in instances},
        private_slots=len(pool._private),
        dedup_segments=pool._dedup,
        evictions=pool._evictions,
        placed=pool._placed,
        placed_at_home=pool._at_home,
        replications=pool.replicator.finished,
        reads={i: reads.get(i, 0) for i in instances},
        tier=None if pool.tier is None else pool.tier.stats(),
    )

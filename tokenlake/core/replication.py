"""Heavy-hitter replication of the cache pool (paper §4.3): copies in flight.

:class:`Replicator` is the part of :class:`~tokenlake.core.pool.CachePool` that starts,
finishes and aborts copies of whole segments between instances. Which segments to copy
where is decided by the pure policies of :mod:`tokenlake.core.placement`
(:func:`~tokenlake.core.placement.find_heavy_hitters`,
:func:`~tokenlake.core.placement.plan_replication`); this module applies the decisions.

Invariants (checked by :meth:`Replicator.check`):

* every copy in flight has a *pending* target replica in the tree, in the slot the copy
  names, and its segment holds one lease per copy in flight (the source is kept until
  the copy is done);
* no two copies in flight target the same (segment, instance).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tokenlake.core.config import PoolConfig
from tokenlake.core.errors import CapacityError, ConfigError, SegmentNotFound
from tokenlake.core.placement import (
    AccessWindow,
    ReplicationDecision,
    expected_load,
    find_heavy_hitters,
    heavy_hitter_budget,
    plan_replication,
)
from tokenlake.core.prefix_tree import PrefixTree, SegmentLocation
from tokenlake.core.segments import SegmentKey
from tokenlake.core.slots import SlotPool


class ReplicaStore(Protocol):
    """What a :class:`Replicator` works on (:class:`~tokenlake.core.pool.CachePool` is
    one; the pool owns its replicator, so this module cannot import the pool)."""

    config: PoolConfig
    clock: Callable[[], float]
    tree: PrefixTree
    window: AccessWindow
    slots: SlotPool

    @property
    def instances(self) -> tuple[int, ...]:
        """The pool's instance ids."""

    def abort(self, key: SegmentKey, instance: int) -> None:
        """Drops the pending replica of ``key`` on ``instance`` (and the node if it was
        the only one) and frees its slot."""

    def evict_one(self, instance: int | None = None) -> object | None:
        """Evicts the least recently used evictable replica on ``instance``, freeing its
        slot (``None`` if nothing there is evictable)."""


@dataclass(frozen=True)
class Replication:
    """A started copy of one whole segment (one contiguous slab copy, docs/design.md §4).

    The target replica is pending until :meth:`Replicator.finish`.
    """

    key: SegmentKey
    source: SegmentLocation  # a ready replica, leased until the copy ends
    target: SegmentLocation  # the pending replica the copy fills


class Replicator:
    """Copies of segments between the instances of one pool, started and not yet done.

    Args:
        pool: the pool whose tree, slots, clock and access window the copies use.
    """

    def __init__(self, pool: ReplicaStore) -> None:
        self._pool = pool
        self._in_flight: dict[tuple[SegmentKey, int], Replication] = {}
        self.finished = 0  # copies completed since creation

    def in_flight(self) -> tuple[Replication, ...]:
        return tuple(self._in_flight.values())

    def heavy_hitters(self) -> list[SegmentKey]:
        """The most accessed segments of the current window (best-first from the root)."""
        return find_heavy_hitters(*self._walk_inputs(self._accesses()))

    def rebalance(self) -> list[Replication]:
        """Starts copying heavy hitters off overloaded instances (paper §4.3).

        Each returned :class:`Replication` has a pending target replica; the transfer
        engine copies the segment and the caller reports back with :meth:`finish` (or
        :meth:`abort`).
        A target without a free slot makes room by evicting its least recently used
        evictable replica when that one is colder (fewer reads in the window) than the
        segment copied there, so replication keeps working once the pool is full.
        """
        pool = self._pool
        acc = self._accesses()
        if not acc:
            return []
        heavy = find_heavy_hitters(*self._walk_inputs(acc))
        decisions = plan_replication(
            heavy, acc, self._holders, expected_load(acc, self._holders), pool.instances,
            high=pool.config.replicate_high, low=pool.config.replicate_low,
            max_decisions=pool.config.max_replications, has_room=self._has_room,
        )
        return [r for d in decisions if (r := self._start(d, acc)) is not None]

    def start(self, key: SegmentKey, target: int) -> Replication:
        """Starts copying segment ``key`` to ``target`` by hand (operators, migration,
        tests). Raises :class:`SegmentNotFound` if it has no ready replica,
        ``ValueError`` if ``target`` already holds it, :class:`ConfigError` for an
        unknown ``target``, :class:`CapacityError` if ``target`` has no free slot."""
        tree = self._pool.tree
        ready = tree.replicas(key)
        if not ready:
            raise SegmentNotFound(f"segment {key.hex()} has no ready replica to copy")
        if any(loc.instance == target for loc in tree.replicas(key, ready_only=False)):
            raise ValueError(f"instance {target} already holds segment {key.hex()}")
        if target not in self._pool.slots.instances:
            raise ConfigError(f"unknown instance {target}")
        rep = self._start(ReplicationDecision(key, ready[0].instance, target))
        if rep is None:
            raise CapacityError(f"instance {target} has no free slot for a replica")
        return rep

    def finish(self, rep: Replication) -> None:
        """The copy is stored in all layers: the target replica becomes ready."""
        tree = self._pool.tree
        self._in_flight.pop((rep.key, rep.target.instance))
        tree.unlease([rep.key])
        tree.set_ready(rep.key, rep.target.instance, self._pool.clock())
        self.finished += 1

    def abort(self, rep: Replication) -> None:
        """The copy failed: its pending target replica and its source lease go."""
        self._in_flight.pop((rep.key, rep.target.instance))
        self._pool.tree.unlease([rep.key], missing_ok=True)
        if rep.key in self._pool.tree:
            self._pool.abort(rep.key, rep.target.instance)

    def abort_touching(self, instance: int) -> None:
        """Aborts every copy from or to ``instance`` (it is leaving the pool)."""
        for rep in list(self._in_flight.values()):
            if instance in (rep.source.instance, rep.target.instance):
                self.abort(rep)

    def void_missing(self) -> None:
        """Forgets copies of segments no longer in the tree (they went with a removed
        instance's subtree, which freed their target slots too)."""
        tree = self._pool.tree
        for where, rep in list(self._in_flight.items()):
            if rep.key not in tree:
                del self._in_flight[where]

    def check(self) -> None:
        """Asserts the invariants listed in the module docstring (for tests)."""
        tree = self._pool.tree
        copies = Counter(key for key, _ in self._in_flight)
        for (key, inst), rep in self._in_flight.items():
            assert (rep.key, rep.target.instance) == (key, inst)
            pending = [loc for loc in tree.replicas(key, ready_only=False) if loc.instance == inst]
            assert pending == [rep.target], "copy without its pending target replica"
            assert rep.target not in tree.replicas(key), "target of a copy in flight is ready"
            assert tree.lease_count(key) >= copies[key], "copy source not leased"

    # -------------------------------------------------------------- internals
    def _accesses(self) -> dict[SegmentKey, int]:
        tree = self._pool.tree
        acc = self._pool.window.segment_accesses(self._pool.clock())
        return {k: c for k, c in acc.items() if k in tree}

    def _walk_inputs(self, acc: dict[SegmentKey, int]):
        pool = self._pool
        budget = heavy_hitter_budget(len(pool.instances), pool.config.heavy_hitter_factor)
        return pool.tree.first_segments(), pool.tree.children, acc, budget  # every salt's too

    def _holders(self, key: SegmentKey) -> list[int]:
        return [loc.instance for loc in self._pool.tree.replicas(key, ready_only=False)]

    def _has_room(self, instance: int) -> bool:
        """A free slot on ``instance``, or an evictable replica there (whether it is
        colder than the segment to copy is checked when the copy starts)."""
        pool = self._pool
        return pool.slots.free_count(instance) > 0 or pool.tree.lru_victim(instance) is not None

    def _start(self, d: ReplicationDecision, acc: dict[SegmentKey, int] | None = None
               ) -> Replication | None:
        pool = self._pool
        src = {loc.instance: loc for loc in pool.tree.replicas(d.key)}.get(d.source)
        if src is None:  # the source replica is still pending
            return None
        slot = pool.slots.allocate(d.target)
        if slot is None and acc is not None:
            # Make room on the target only, and only for a hotter segment.
            victim = pool.tree.lru_victim(d.target)
            if victim is not None and acc.get(victim[0], 0) < acc.get(d.key, 0):
                pool.evict_one(d.target)
                slot = pool.slots.allocate(d.target)
        if slot is None:
            return None
        pool.tree.add_replica(d.key, d.target, slot, pool.clock())
        pool.tree.lease([d.key])  # keep the source until the copy is done
        rep = Replication(d.key, src, SegmentLocation(d.target, slot))
        self._in_flight[(d.key, d.target)] = rep
        return rep

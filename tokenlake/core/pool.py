"""The cache manager of the global pool: slots, placement, eviction, replication.

:class:`CachePool` is the single writer of cache metadata (DESIGN §2). It combines the
mechanism (:class:`~tokenlake.core.slots.SlotPool`, :class:`~tokenlake.core.prefix_tree.PrefixTree`)
with the policies of :mod:`tokenlake.core.placement`:

* a new segment goes to its home on the hash ring, spilling along the ring when the
  home is full; when the whole pool is full the globally least recently used evictable
  replica is evicted and its slot reused; if nothing is evictable (all pinned, leased
  or pending) a :class:`~tokenlake.core.errors.CapacityError` is raised;
* open tails of running requests live in *private* slots until they fill;
* :meth:`CachePool.rebalance` finds heavy hitters and starts replications.

Time comes from an injected clock and randomness from an injected ``random.Random``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tokenlake.core.config import PoolConfig
from tokenlake.core.errors import CapacityError, ConfigError, PrefixNotCached, SegmentNotFound
from tokenlake.core.placement import (
    AccessWindow,
    HashRing,
    ReplicationDecision,
    choose_replica,
    expected_load,
    find_heavy_hitters,
    heavy_hitter_budget,
    plan_replication,
)
from tokenlake.core.prefix_tree import MatchResult, PrefixTree, SegmentLocation
from tokenlake.core.segments import SegmentHasher, SegmentKey
from tokenlake.core.slots import SlotPool


@dataclass(frozen=True)
class Replication:
    """A started copy of one whole segment (one contiguous slab copy, DESIGN §4).

    The target replica is pending until :meth:`CachePool.finish_replication`.
    """

    key: SegmentKey
    source: SegmentLocation
    target: SegmentLocation


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
    replications: int = 0  # replicas created by rebalancing
    reads: Mapping[int, int] = field(default_factory=dict)  # cumulative segment reads per instance


class CachePool:
    """The global segment pool of one cluster (control-plane metadata only)."""

    def __init__(
        self,
        config: PoolConfig,
        instances: Sequence[int],
        clock: Callable[[], float],
        rng: random.Random | None = None,
    ) -> None:
        if not instances:
            raise ConfigError("a pool needs at least one instance")
        self.config = config
        self.clock = clock
        self.rng = rng if rng is not None else random.Random(config.seed)
        self.hasher = SegmentHasher(config.segment_tokens, config.namespace)
        self.tree = PrefixTree(self.hasher)
        self.ring = HashRing(vnodes=config.vnodes)
        self.window = AccessWindow(config.window_s, config.bucket_s)
        self.slots = SlotPool()
        self._private: dict[tuple[int, int], str] = {}  # (instance, slot) -> owner
        self._replicating: dict[tuple[SegmentKey, int], Replication] = {}
        self._dedup = self._evictions = self._replications = 0
        # While not None, evict_one() notes what it evicts here so that a plan that fails
        # before any data moved can put it back (see restore_evicted).
        self.eviction_log: list[tuple] | None = None
        for inst in instances:
            self.add_instance(inst)

    # -------------------------------------------------------------- instances
    @property
    def instances(self) -> tuple[int, ...]:
        return self.slots.instances

    def add_instance(self, instance: int, slots: int | None = None) -> None:
        """Adds an empty instance; about 1/N of future homes move to it."""
        self.slots.add_instance(instance, self.config.slots_per_instance if slots is None else slots)
        self.ring.add(instance)

    def remove_instance(self, instance: int) -> InstanceRemoval:
        """Takes a (failed) instance out: its replicas go, and so does every segment
        whose only replica was there, with its whole subtree (a missing middle segment
        would orphan its suffix). Slots those subtrees held elsewhere are freed."""
        if instance not in self.slots.instances:
            raise ConfigError(f"unknown instance {instance}")
        for rep in list(self._replicating.values()):
            if instance in (rep.source.instance, rep.target.instance):
                self.abort_replication(rep)
        gone: list[SegmentKey] = []
        for key in list(self.tree.keys()):
            if key not in self.tree:
                continue
            locs = self.tree.replicas(key, ready_only=False)
            if not any(loc.instance == instance for loc in locs):
                continue
            if len(locs) > 1:
                self.tree.remove_replica(key, instance)
                continue
            for k, inst, slot in self.tree.remove_subtree(key):
                if not gone or gone[-1] != k:  # one entry per segment, not per replica
                    gone.append(k)
                if inst != instance:
                    self.slots.free(inst, slot)
        # Copies between other instances of segments that went with a subtree are void:
        # their target slots were freed above, and the key may be inserted again later.
        for where, rep in list(self._replicating.items()):
            if rep.key not in self.tree:
                del self._replicating[where]
        lost = tuple(o for (i, _), o in self._private.items() if i == instance)
        self._private = {loc: o for loc, o in self._private.items() if loc[0] != instance}
        self.ring.remove(instance)
        self.slots.remove_instance(instance)
        self.window.forget_instance(instance)
        return InstanceRemoval(instance, tuple(gone), lost)

    # ---------------------------------------------------------------- lookup
    def match(self, token_ids: Sequence[int] | bytes, max_tokens: int | None = None) -> MatchResult:
        return self.tree.match(token_ids, max_tokens)

    def choose(self, locations: Sequence[SegmentLocation], load: Mapping[int, float]) -> SegmentLocation:
        """Power-of-two-choices among a segment's ready replicas."""
        if len(locations) == 1:
            return locations[0]
        by_inst = {loc.instance: loc for loc in locations}
        return by_inst[choose_replica(sorted(by_inst), load, self.rng)]

    # ------------------------------------------------------------- placement
    def place(self, key: SegmentKey, parent: SegmentKey | None, index: int) -> tuple[SegmentLocation, bool]:
        """Makes sure segment ``key`` is in the tree.

        Returns ``(location, created)``: a new pending replica at the segment's home
        (``created``), or an existing replica (dedup: the caller skips storing it).
        """
        if key in self.tree:
            self._dedup += 1
            locs = self.tree.replicas(key, ready_only=False)
            ready = self.tree.replicas(key)
            return (ready or locs)[0], False
        if parent is None and index != 0:
            raise ValueError("a segment without parent must have index 0")
        if parent is not None and self.tree.index(parent) != index - 1:  # raises SegmentNotFound
            raise ValueError("segment index must be its parent's index + 1")
        # On a full pool the parent may be the LRU victim: keep it while a slot is taken
        # for its child, or eviction could pull it from under the insert (and leak the slot).
        guard = parent is not None and not self.slots.total_free()
        if guard:
            self.tree.lease([parent])
        try:
            loc = self._take_slot(key)
        finally:
            if guard:
                self.tree.unlease([parent])
        self.tree.insert(key, parent, index)
        self.tree.add_replica(key, loc.instance, loc.slot, self.clock())
        return loc, True

    def commit(self, key: SegmentKey, instance: int) -> None:
        """All layers of the replica on ``instance`` are stored: the segment is visible."""
        self.tree.set_ready(key, instance, self.clock())

    def abort(self, key: SegmentKey, instance: int) -> None:
        """A put failed: drops the pending replica (and the node if it was the only one)."""
        slot = self.tree.remove_replica(key, instance)
        self.slots.free(instance, slot)

    def allocate_private(self, owner: str, hint: bytes) -> SegmentLocation:
        """A private slot for an open tail, placed by hashing ``hint`` on the ring."""
        digest = hashlib.blake2b(hint, digest_size=16).digest()
        loc = self._take_slot(digest)
        self._private[(loc.instance, loc.slot)] = owner
        return loc

    def release_private(self, loc: SegmentLocation, owner: str | None = None) -> None:
        """Frees a private slot. With ``owner``, a slot that is no longer ``owner``'s
        private tail (it went with a removed instance) is left alone."""
        where = (loc.instance, loc.slot)
        if owner is not None and self._private.get(where) != owner:
            return
        if self._private.pop(where, None) is None:
            raise SegmentNotFound(f"no private slot {loc.slot} on instance {loc.instance}")
        self.slots.free(loc.instance, loc.slot)

    def seal_private(
        self, loc: SegmentLocation, key: SegmentKey, parent: SegmentKey | None, index: int
    ) -> None:
        """A private tail filled up and became the new segment ``key``: its slot becomes
        the segment's first (pending) replica. The caller handles an already cached
        ``key`` itself (dedup) and keeps the private slot until its plan completes."""
        if key in self.tree:
            raise ValueError(f"segment {key.hex()} is already cached; dedup instead of sealing")
        if (loc.instance, loc.slot) not in self._private:
            raise SegmentNotFound(f"no private slot {loc.slot} on instance {loc.instance}")
        self.tree.insert(key, parent, index)
        del self._private[(loc.instance, loc.slot)]
        self.tree.add_replica(key, loc.instance, loc.slot, self.clock())

    def unseal(self, key: SegmentKey, loc: SegmentLocation, owner: str) -> None:
        """Undoes :meth:`seal_private` of a plan that could not be completed."""
        slot = self.tree.remove_replica(key, loc.instance)
        self._private[(loc.instance, slot)] = owner

    def count_dedup(self, n: int = 1) -> None:
        """Counts segments that were found cached instead of being stored again."""
        self._dedup += n

    def _take_slot(self, key: SegmentKey) -> SegmentLocation:
        """A free slot, spilling along the ring from ``key``'s home; on a full pool the
        least recently used replica goes and its slot (the only free one) is taken."""
        if self.slots.total_free():
            for inst in self.ring.preference(key):
                slot = self.slots.allocate(inst)
                if slot is not None:
                    return SegmentLocation(inst, slot)
        inst = self._evict_lru()
        if inst is None:
            raise CapacityError(
                f"pool full: {sum(self.slots.capacity(i) for i in self.instances)} slots are all "
                "pinned, leased, pending or private"
            )
        return SegmentLocation(inst, self.slots.allocate(inst))

    def evict_one(self) -> bool:
        """Evicts the least recently used evictable replica; False if there is none."""
        return self._evict_lru() is not None

    def _evict_lru(self) -> int | None:
        """Evicts the least recently used evictable replica; returns the instance whose
        slot it freed, or ``None`` if nothing is evictable."""
        victim = self.tree.lru_victim()
        if victim is None:
            return None
        key, inst = victim
        parent, index = self.tree.parent(key), self.tree.index(key)
        last = self.tree.last_access(key, inst)
        slot = self.tree.remove_replica(key, inst)
        self.slots.free(inst, slot)
        self._evictions += 1
        if self.eviction_log is not None:
            self.eviction_log.append((key, parent, index, inst, slot, last))
        return inst

    def restore_evicted(self, log: list[tuple]) -> None:
        """Puts back the replicas noted in ``log`` (newest first), for a plan that failed
        before the data plane saw it: their slots still hold the segments' data. The
        slots must be free again (the failed plan's allocations undone)."""
        for key, parent, index, inst, slot, last in reversed(log):
            self.slots.take(inst, slot)
            if key not in self.tree:
                self.tree.insert(key, parent, index)
            self.tree.add_replica(key, inst, slot, last, ready=True)
            self._evictions -= 1
        log.clear()

    # ---------------------------------------------------------- pins, access
    def pin(self, token_ids: Sequence[int]) -> MatchResult:
        """Pins the cached whole segments of ``token_ids`` (system prompts, documents).

        Raises :class:`PrefixNotCached` unless every full segment is cached and ready.
        """
        m = self.tree.match(token_ids)
        if m.num_segments < self.hasher.num_full(len(token_ids)):
            raise PrefixNotCached(
                f"only {m.hit_tokens} of {len(token_ids)} tokens are cached; put them first"
            )
        self.tree.pin(m.keys)
        return m

    def unpin(self, keys: Iterable[SegmentKey]) -> None:
        self.tree.unpin(keys)

    def record_access(self, chains: Iterable[tuple[tuple[SegmentKey, ...], Mapping[int, int]]]) -> None:
        """One read of each segment of each chain (see :meth:`AccessWindow.record_many`)."""
        self.window.record_many(chains, self.clock())

    def instance_load(self) -> dict[int, int]:
        """Segment reads served by each instance in the current window."""
        acc = self.window.instance_accesses(self.clock())
        return {i: acc.get(i, 0) for i in self.instances}

    # ------------------------------------------------------------- rebalance
    def heavy_hitters(self) -> list[SegmentKey]:
        acc = self.window.segment_accesses(self.clock())
        budget = heavy_hitter_budget(len(self.instances), self.config.heavy_hitter_factor)
        return find_heavy_hitters(
            self.tree.children(None), self.tree.children, {k: c for k, c in acc.items() if k in self.tree}, budget
        )

    def rebalance(self) -> list[Replication]:
        """Starts replicating heavy hitters off overloaded instances (paper §4.3).

        Each returned :class:`Replication` has a pending target replica; the transfer
        engine copies the segment and the caller reports back with
        :meth:`finish_replication` (or :meth:`abort_replication`).
        """
        now = self.clock()
        acc = {k: c for k, c in self.window.segment_accesses(now).items() if k in self.tree}
        if not acc:
            return []
        budget = heavy_hitter_budget(len(self.instances), self.config.heavy_hitter_factor)
        heavy = find_heavy_hitters(self.tree.children(None), self.tree.children, acc, budget)
        holders = self._holders
        decisions = plan_replication(
            heavy, acc, holders, expected_load(acc, holders), self.instances,
            high=self.config.replicate_high, low=self.config.replicate_low,
            max_decisions=self.config.max_replications, has_room=self._has_room,
        )
        return [r for d in decisions if (r := self._start_replication(d)) is not None]

    def start_replication(self, key: SegmentKey, target: int) -> Replication:
        """Starts copying segment ``key`` to ``target`` by hand (operators, migration,
        tests). Raises :class:`SegmentNotFound` if it has no ready replica,
        ``ValueError`` if ``target`` already holds it, :class:`CapacityError` if
        ``target`` has no free slot."""
        ready = self.tree.replicas(key)
        if not ready:
            raise SegmentNotFound(f"segment {key.hex()} has no ready replica to copy")
        if any(loc.instance == target for loc in self.tree.replicas(key, ready_only=False)):
            raise ValueError(f"instance {target} already holds segment {key.hex()}")
        if target not in self.slots.instances:
            raise ConfigError(f"unknown instance {target}")
        rep = self._start_replication(ReplicationDecision(key, ready[0].instance, target))
        if rep is None:
            raise CapacityError(f"instance {target} has no free slot for a replica")
        return rep

    def _holders(self, key: SegmentKey) -> list[int]:
        return [loc.instance for loc in self.tree.replicas(key, ready_only=False)]

    def _has_room(self, instance: int) -> bool:
        return self.slots.free_count(instance) > 0 or self.tree.evictable_count() > 0

    def _start_replication(self, d: ReplicationDecision) -> Replication | None:
        slot = self.slots.allocate(d.target)
        if slot is None:
            # Make room on the target only; never evict the segment being copied.
            return None
        src = {loc.instance: loc for loc in self.tree.replicas(d.key)}.get(d.source)
        if src is None:
            self.slots.free(d.target, slot)
            return None
        self.tree.add_replica(d.key, d.target, slot, self.clock())
        self.tree.lease([d.key])  # keep the source until the copy is done
        rep = Replication(d.key, src, SegmentLocation(d.target, slot))
        self._replicating[(d.key, d.target)] = rep
        return rep

    def finish_replication(self, rep: Replication) -> None:
        self._replicating.pop((rep.key, rep.target.instance))
        self.tree.unlease([rep.key])
        self.tree.set_ready(rep.key, rep.target.instance, self.clock())
        self._replications += 1

    def abort_replication(self, rep: Replication) -> None:
        self._replicating.pop((rep.key, rep.target.instance))
        self.tree.unlease([rep.key], missing_ok=True)
        if rep.key in self.tree:
            self.abort(rep.key, rep.target.instance)

    # ------------------------------------------------------------------ stats
    def stats(self) -> PoolStats:
        replicas = pinned = 0
        reads = self.window.total_instance_accesses(self.clock())
        for key in self.tree.keys():
            replicas += len(self.tree.replicas(key, ready_only=False))
            pinned += self.tree.is_pinned(key)
        return PoolStats(
            segments=len(self.tree),
            replicas=replicas,
            pinned=pinned,
            slots_used={i: self.slots.used(i) for i in self.instances},
            slots_capacity={i: self.slots.capacity(i) for i in self.instances},
            private_slots=len(self._private),
            dedup_segments=self._dedup,
            evictions=self._evictions,
            replications=self._replications,
            reads={i: reads.get(i, 0) for i in self.instances},
        )

"""The cache manager of the global pool: slots, placement, eviction, replication.

:class:`CachePool` is the single writer of cache metadata (docs/design.md §2): every change to
the prefix tree and the slots goes through it. It applies the policies of
:mod:`tokenlake.core.placement` to the mechanism (:class:`~tokenlake.core.slots.SlotPool`,
:class:`~tokenlake.core.prefix_tree.PrefixTree`):

* a new segment goes to its home on the hash ring (paper §4.3). A full home spills
  along the ring while the pool has free slots elsewhere; once the whole pool is full
  the home's least recently used evictable replica is evicted and its slot reused, so
  in steady state every new segment lands at its home. Only a home with nothing
  evictable (all pinned, leased or pending) takes the globally least recently used
  replica's slot instead; if nothing at all is evictable a
  :class:`~tokenlake.core.errors.CapacityError` is raised;
* open tails of running requests live in *private* slots until they fill;
* copies of heavy hitters are started and finished by its
  :class:`~tokenlake.core.replication.Replicator`; a disk tier, by its
  :class:`~tokenlake.core.tier.TierManager` (``tier``, None without one).

An eviction is returned to the caller as an :class:`Eviction` record: a caller whose
plan fails before any data moved puts it back with :meth:`CachePool.restore_evicted`.
Invariant (checked by :meth:`CachePool.check`, with the tree's, the slots', the
replicator's and the tier's): every used slot holds exactly one replica or one private
tail. Time comes from an injected clock, randomness from an injected ``random.Random``.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Iterable, Mapping, Sequence

from tokenlake.core.config import PoolConfig
from tokenlake.core.errors import CapacityError, ConfigError, PrefixNotCached, SegmentNotFound
from tokenlake.core.placement import AccessWindow, HashRing, choose_replica
from tokenlake.core.pool_records import (
    Eviction,
    InstanceRemoval,
    Placement,
    PoolStats,
    collect_stats,
)
from tokenlake.core.prefix_tree import MatchResult, PrefixTree, SegmentLocation
from tokenlake.core.replication import Replication, Replicator
from tokenlake.core.segments import SegmentHasher, SegmentKey
from tokenlake.core.slots import SlotPool
from tokenlake.core.tier import TierManager

__all__ = ["CachePool", "Eviction", "InstanceRemoval", "Placement", "PoolStats"]


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
        self.tree = PrefixTree(self.hasher, config.page_tokens)
        self.ring = HashRing(vnodes=config.vnodes)
        self.window = AccessWindow(config.window_s, config.bucket_s)
        self.slots = SlotPool()
        self.replicator = Replicator(self)
        self.tier = TierManager(self, config.tier_slots) if config.tier_slots else None
        self._private: dict[tuple[int, int], str] = {}  # (instance, slot) -> owner
        self._dedup = self._evictions = 0
        self._placed = self._at_home = 0
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
        if self.tier is not None:
            self.tier.instance_added(instance)

    def remove_instance(self, instance: int) -> InstanceRemoval:
        """Takes a (failed) instance out: its replicas go, and so does every segment
        whose only replica was there, with its whole subtree (a missing middle segment
        would orphan its suffix). Slots those subtrees held elsewhere are freed."""
        if instance not in self.slots.instances:
            raise ConfigError(f"unknown instance {instance}")
        self.replicator.abort_touching(instance)
        if self.tier is not None:
            self.tier.forget_instance(instance)
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
        self.replicator.void_missing()
        lost = tuple(o for (i, _), o in self._private.items() if i == instance)
        self._private = {loc: o for loc, o in self._private.items() if loc[0] != instance}
        self.ring.remove(instance)
        self.slots.remove_instance(instance)
        self.window.forget_instance(instance)
        return InstanceRemoval(instance, tuple(gone), lost)

    # ---------------------------------------------------------------- lookup
    def match(self, token_ids: Sequence[int] | bytes, max_tokens: int | None = None,
              salt: str | None = None) -> MatchResult:
        return self.tree.match(token_ids, max_tokens, salt)

    def choose(self, locations: Sequence[SegmentLocation], load: Mapping[int, float]) -> SegmentLocation:
        """Power-of-two-choices among a segment's ready replicas (``shared_memory``: the lowest instance's)."""
        if len(locations) == 1 or self.config.shared_memory:
            return min(locations, key=lambda loc: (loc.instance, loc.slot))
        by_inst = {loc.instance: loc for loc in locations}
        return by_inst[choose_replica(sorted(by_inst), load, self.rng)]

    # ------------------------------------------------------------- placement
    def place(self, key: SegmentKey, parent: SegmentKey | None, index: int,
              tokens: Sequence[int] | bytes | None = None) -> Placement:
        """Makes sure segment ``key`` is in the tree (with its ``tokens``, which make it
        a candidate for page hits).

        Returns a new pending replica at the segment's home (``created``; ``evicted``
        names the replica evicted to make room, if any), or an existing replica (dedup:
        the caller skips storing it). Raises :class:`CapacityError` on a full pool.
        A first segment's ``parent`` is a root: ``None``, or its salt's root key
        (:meth:`PrefixTree.root_key`).
        """
        known = key in self.tree
        if known and (locs := self.tree.replicas(key, ready_only=False)):
            self._dedup += 1
            return Placement((self.tree.replicas(key) or locs)[0], False)
        if not known:  # else held only in the tier: computed again into a slot
            self.tree.check_parent(parent, index)  # ValueError, SegmentNotFound
        # On a full pool the parent may be the LRU victim: keep it while a slot is taken
        # for its child, or eviction could pull it from under the insert (and leak the slot).
        guard = index > 0 and not self.slots.total_free()
        if guard:
            self.tree.lease([parent])
        try:
            loc, evicted = self._take_slot(key)
        finally:
            if guard:
                self.tree.unlease([parent])
        if not known:
            self.tree.insert(key, parent, index, tokens)
        self.tree.add_replica(key, loc.instance, loc.slot, self.clock())
        return Placement(loc, True, evicted)

    def commit(self, key: SegmentKey, instance: int) -> None:
        """All layers of the replica on ``instance`` are stored: the segment is visible."""
        self.tree.set_ready(key, instance, self.clock())
        if self.tier is not None:
            self.tier.committed(key, instance)

    def abort(self, key: SegmentKey, instance: int) -> None:
        """A put failed: drops the pending replica (and the node if it was the only one)."""
        slot = self.tree.remove_replica(key, instance)
        self.slots.free(instance, slot)

    def drop_replica(self, key: SegmentKey, instance: int) -> None:
        """Frees one replica of a segment that has another ready one (migration's last
        step). Raises ``ValueError`` if it is the only ready replica."""
        if not any(loc.instance != instance for loc in self.tree.replicas(key)):
            raise ValueError(f"segment {key.hex()} has no other ready replica")
        self.abort(key, instance)

    def allocate_private(self, owner: str, hint: bytes, instance: int | None = None) -> Placement:
        """A private slot for an open tail, placed by hashing ``hint`` on the ring, or,
        when ``instance`` is given, on that instance only (a free slot or its least
        recently used evictable replica's). ``created`` is always True. Raises
        :class:`CapacityError` when no slot can be had."""
        if instance is not None:
            if instance not in self.slots.instances:
                raise ConfigError(f"unknown instance {instance}")
            slot, evicted = self.slots.allocate(instance), None
            if slot is None:
                evicted = self.evict_one(instance)
                if evicted is None:
                    raise CapacityError(f"instance {instance} is full: every slot is pinned, "
                                        "leased, pending or private")
                slot = self.slots.allocate(instance)
            self._private[(instance, slot)] = owner
            return Placement(SegmentLocation(instance, slot), True, evicted)
        digest = hashlib.blake2b(hint, digest_size=16).digest()
        loc, evicted = self._take_slot(digest)
        self._private[(loc.instance, loc.slot)] = owner
        return Placement(loc, True, evicted)

    def release_private(self, loc: SegmentLocation, owner: str | None = None) -> None:
        """Frees a private slot. With ``owner``, a slot that is no longer ``owner``'s
        private tail (it went with a removed instance) is left alone."""
        where = (loc.instance, loc.slot)
        if owner is not None and self._private.get(where) != owner:
            return
        if self._private.pop(where, None) is None:
            raise SegmentNotFound(f"no private slot {loc.slot} on instance {loc.instance}")
        self.slots.free(loc.instance, loc.slot)

    def share_tail(self, loc: SegmentLocation, owner: str, parent: SegmentKey | None,
                   index: int, tokens: Sequence[int]) -> bool:
        """A finished request's open tail (``tokens``, fewer than ``C``, all stored in
        ``loc``) stays in the pool as a ready *tail* node after ``parent`` for page hits
        (docs/design.md §4), evicted like any leaf (``parent``: a root for a tail at
        ``index`` 0, ``None`` or its salt's root key). Returns False, freeing the slot
        instead, when it holds less than a page, is cached already, or ``parent`` is
        gone; a slot that is no longer ``owner``'s private tail is left alone."""
        where = (loc.instance, loc.slot)
        if self._private.get(where) != owner:
            return False
        key = self.hasher.tail_key(tokens, parent)
        if (len(tokens) < self.config.page_tokens or key in self.tree
                or (index > 0 and parent not in self.tree)):
            self.release_private(loc, owner)
            return False
        self.tree.insert(key, parent, index, tokens)
        del self._private[where]
        self.tree.add_replica(key, loc.instance, loc.slot, self.clock(), ready=True)
        return True

    def private_owner(self, loc: SegmentLocation) -> str | None:
        """The owner of private slot ``loc``, or ``None`` if it is not a private slot."""
        return self._private.get((loc.instance, loc.slot))

    def seal_private(self, loc: SegmentLocation, key: SegmentKey, parent: SegmentKey | None,
                     index: int, tokens: Sequence[int] | bytes | None = None) -> None:
        """A private tail filled up and became the new segment ``key``: its slot becomes
        the segment's first (pending) replica. The caller handles an already cached
        ``key`` itself (dedup) and keeps the private slot until its plan completes."""
        known = key in self.tree  # held only in the disk tier: stored again here
        if known and self.tree.replicas(key, ready_only=False):
            raise ValueError(f"segment {key.hex()} is already cached; dedup instead of sealing")
        if (loc.instance, loc.slot) not in self._private:
            raise SegmentNotFound(f"no private slot {loc.slot} on instance {loc.instance}")
        if not known:
            self.tree.insert(key, parent, index, tokens)
        del self._private[(loc.instance, loc.slot)]
        self.tree.add_replica(key, loc.instance, loc.slot, self.clock())

    def unseal(self, key: SegmentKey, loc: SegmentLocation, owner: str) -> None:
        """Undoes :meth:`seal_private` of a plan that could not be completed."""
        slot = self.tree.remove_replica(key, loc.instance)
        self._private[(loc.instance, slot)] = owner

    def count_placement(self, key: SegmentKey, instance: int) -> None:
        """A segment :meth:`place` gave a slot on ``instance`` was stored (statistics:
        how many land on their hash home)."""
        self._placed += 1
        self._at_home += instance == self.ring.home(key)

    def count_dedup(self, n: int = 1) -> None:
        """Counts segments found cached instead of stored again (``n < 0``: undone)."""
        self._dedup += n

    # ------------------------------------------------------------- eviction
    def _take_slot(self, key: SegmentKey) -> tuple[SegmentLocation, Eviction | None]:
        """A slot at ``key``'s home: a free one there, else a free one along the ring,
        else the slot of the least recently used evictable replica on the home and the
        next ``eviction_choices - 1`` instances along the ring, else that of the pool's."""
        home = self.ring.home(key)
        slot = self.slots.allocate(home)
        if slot is not None:
            return SegmentLocation(home, slot), None
        if self.slots.total_free():
            for inst in self.ring.preference(key):
                slot = self.slots.allocate(inst)
                if slot is not None:
                    return SegmentLocation(inst, slot), None
        evicted = None
        if self.config.home_eviction:  # the home first in ring order, then the next ones
            evicted = self.evict_one(
                tuple(itertools.islice(self.ring.preference(key), self.config.eviction_choices)))
        if evicted is None:
            evicted = self.evict_one()
        if evicted is None:
            raise CapacityError(
                f"pool full: {sum(self.slots.capacity(i) for i in self.instances)} slots are all "
                "pinned, leased, pending or private"
            )
        inst = evicted.instance
        return SegmentLocation(inst, self.slots.allocate(inst)), evicted

    def evict_one(self, instance: int | tuple[int, ...] | None = None) -> Eviction | None:
        """Evicts the least recently used evictable replica (on ``instance`` only, or on
        those instances, if given), freeing its slot; ``None`` if nothing is evictable
        there."""
        victim = self.tree.lru_victim(instance)
        if victim is None:
            return None
        key, inst = victim
        tree = self.tree
        parent, index, tokens = tree.parent(key), tree.index(key), tree.tokens(key)
        last = tree.last_access(key, inst)
        slot = tree.remove_replica(key, inst)
        self.slots.free(inst, slot)
        self._evictions += 1
        if self.tier is not None and key in tree and tree.node(key).tier_only:
            self.tier.demoted(key, last)
        return Eviction(key, parent, index, inst, slot, last, tokens)

    def restore_evicted(self, evictions: Sequence[Eviction]) -> None:
        """Puts back evicted replicas (given oldest first; restored newest first), for
        a plan that failed before the data plane saw it: their slots still hold the
        segments' data. The slots must be free again (the failed plan's allocations
        undone). Each replica gets back its slot and LRU time; among replicas of equal
        LRU time and depth it rejoins at the end of the tie."""
        for ev in reversed(evictions):
            self.slots.take(ev.instance, ev.slot)
            if ev.key not in self.tree:
                self.tree.insert(ev.key, ev.parent, ev.index, ev.tokens)
            self.tree.add_replica(ev.key, ev.instance, ev.slot, ev.last_access, ready=True)
            self._evictions -= 1

    # ---------------------------------------------------- pins, leases, access
    def pin(self, token_ids: Sequence[int], salt: str | None = None) -> MatchResult:
        """Pins the cached whole segments of ``token_ids`` (system prompts, documents),
        stored under cache salt ``salt`` (``None``: none).

        Raises :class:`PrefixNotCached` unless every full segment is cached and ready.
        """
        m = self.tree.match(token_ids, salt=salt)
        if m.num_segments < self.hasher.num_full(len(token_ids)):
            raise PrefixNotCached(
                f"only {m.hit_tokens} of {len(token_ids)} tokens are cached; put them first"
            )
        self.tree.pin(m.keys)
        return m

    def unpin(self, keys: Iterable[SegmentKey]) -> None:
        self.tree.unpin(keys)

    def lease(self, keys: Iterable[SegmentKey]) -> None:
        """Keeps segments from eviction while a request or plan references them (counted)."""
        self.tree.lease(keys)

    def unlease(self, keys: Iterable[SegmentKey], missing_ok: bool = False) -> None:
        """Releases leases; with ``missing_ok`` segments already gone (failures) are skipped."""
        self.tree.unlease(keys, missing_ok)

    def release_chain(
        self, chain: Sequence[SegmentKey], reads: Iterable[tuple[SegmentKey, int]]
    ) -> None:
        """A request is done with its leased ``chain``. Each ``(key, instance)`` of
        ``reads`` (the replicas it read) is touched now, the release being its last
        access for LRU; then the chain is unleased (segments already gone are skipped)."""
        tree, now = self.tree, self.clock()
        for key, inst in reads:
            if key in tree and any(loc.instance == inst for loc in tree.replicas(key)):
                tree.touch(key, inst, now)
        tree.unlease(chain, missing_ok=True)

    def record_access(self, chains: Iterable[tuple[tuple[SegmentKey, ...], Mapping[int, int]]]) -> None:
        """One read of each segment of each chain (see :meth:`AccessWindow.record_many`)."""
        self.window.record_many(chains, self.clock())

    def instance_load(self) -> dict[int, int]:
        """Segment reads served by each instance in the current window."""
        acc = self.window.instance_accesses(self.clock())
        return {i: acc.get(i, 0) for i in self.instances}

    # ------------------------------------------------------------- rebalance
    def rebalance(self) -> list[Replication]:
        """Starts copies of heavy hitters off overloaded instances (see
        :meth:`Replicator.rebalance`); each ends with :meth:`finish_replication` or
        :meth:`abort_replication`. None with ``config.shared_memory``."""
        return [] if self.config.shared_memory else self.replicator.rebalance()

    def start_replication(self, key: SegmentKey, target: int) -> Replication:
        """Starts one copy by hand (see :meth:`Replicator.start`)."""
        return self.replicator.start(key, target)

    def finish_replication(self, rep: Replication) -> None:
        self.replicator.finish(rep)

    def abort_replication(self, rep: Replication) -> None:
        self.replicator.abort(rep)

    # ------------------------------------------------------------------ stats
    def stats(self) -> PoolStats:
        return collect_stats(self)

    def check(self) -> None:
        """Asserts the invariants of the module docstring, the tree's and the
        replicator's (for tests)."""
        self.tree.check()
        self.slots.check()
        self.replicator.check()
        if self.tier is not None:
            self.tier.check()
        held = [(loc.instance, loc.slot) for key in self.tree.keys()
                for loc in self.tree.replicas(key, ready_only=False)] + list(self._private)
        held += self.tier.held_back() if self.tier is not None else []
        assert len(held) == len(set(held)), "a slot holds two things"
        assert {i for i, _ in held} <= set(self.instances), "replica on an unknown instance"
        for inst in self.instances:
            mine = [s for i, s in held if i == inst]
            assert all(0 <= s < self.slots.capacity(inst) for s in mine), "slot out of range"
            assert len(mine) == self.slots.used(inst), f"slot accounting off on instance {inst}"

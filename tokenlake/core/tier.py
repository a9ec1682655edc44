"""The tier below the pool: what the control plane knows of each instance's disk tier.

With a tier (``PoolConfig.tier_slots``: segments each instance's tier holds) every
segment is *written through*: once all its layers are stored in a slot
(:meth:`~tokenlake.core.pool.CachePool.commit`), the instance that holds it also keeps a
copy in its tier (the transfer engine stages the slot's bytes and writes the file in
the background: :mod:`tokenlake.engines.tier_files`). A segment evicted from the slabs
then stays in the prefix tree, *held only in the tier*, instead of leaving it: a match
stops before it, as before, but reports it (``MatchResult.tier_keys``), and the caller
promotes it first: a slot on the instance that holds the copy, the file read into it,
the replica ready again. So a tier is an inclusive second level: a segment in a slab
usually has a copy below as well, and evicting it from the slab moves no data.

This module is bookkeeping only, like the rest of :mod:`tokenlake.core`: the data moves
are handed to whoever runs the data plane as :class:`TierOps` (per instance: files to
drop, slots to write through) and :class:`Promotion` records; without one (the
simulator, the core's tests) they count as done at once.

Rules, checked by :meth:`TierManager.check`:

* a node's ``tier`` names the one instance whose tier holds its copy, and every such
  copy is in the tier's LRU index under that instance; an instance's tier holds at most
  ``tier_slots`` copies;
* a node held only in the tier has only children held only in the tier (promotion goes
  parent first, and a segment computed again is placed in a slot again);
* a write-through in flight holds a lease on its node, so the slot it reads is not
  reused before the transfer engine has staged its bytes; a node that goes anyway (its
  instance failed) takes its queued write along. The data plane runs the queued work
  it takes before the pool changes again (the driver does it inside the call that
  queued it, under the control plane's lock).

The tier evicts its least recently used copy that no child held only in the tier needs
(a copy is stamped when written, when its segment leaves the slabs and when it is
promoted); dropping a copy whose segment is still in a slab loses nothing now.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

from sortedcontainers import SortedList

from tokenlake.core.errors import CapacityError
from tokenlake.core.segments import SegmentKey
from tokenlake.core.tier_types import Promotion, TierDataPlane, TierOps, TierStats, TierWrite
from tokenlake.core.tree_nodes import TreeNode

#: The epoch of a held slot whose read has not ended yet (above any fence).
_IN_FLIGHT = 1 << 62

__all__ = ["Promotion", "TierDataPlane", "TierManager", "TierOps", "TierStats", "TierWrite"]


class TierManager:
    """The tiers of a :class:`~tokenlake.core.pool.CachePool` (see the module docstring).

    ``slots``: copies one instance's tier holds. The pool calls :meth:`committed`,
    :meth:`demoted` and :meth:`forget_instance`; the data plane's driver takes
    :meth:`take_ops`, answers with :meth:`staged`, and runs :meth:`promote` /
    :meth:`promoted` / :meth:`promotion_failed`."""

    def __init__(self, pool, slots: int) -> None:  # pool: a CachePool (which imports this)
        if slots < 1:
            raise ValueError(f"a tier holds at least one segment, got {slots}")
        self.pool = pool
        self.tree = pool.tree
        self.slots = slots
        self._lru: dict[int, SortedList] = {}  # per instance: (stamp, -index, seq, key)
        self._seq = itertools.count()
        self._ops: dict[int, TierOps] = {}
        self._staging: dict[SegmentKey, int] = {}  # write-throughs in flight -> instance
        # per reading instance: slots (instance, slot) an unanswered read may still write
        self._held_back: dict[int, list[tuple[int, int, int]]] = {}  # (instance, slot, epoch)
        # ... of those, the ones in the slab of an instance that left (its memory may be
        # given back to it when it joins again: instance_added takes them once more)
        self._held_gone: dict[int, list[tuple[int, int, int]]] = {}
        self._reading: dict[int, Promotion] = {}  # id -> promotions begun, not ended
        self.written = self.demotions = self.promotions = 0
        self.failed_promotions = self.dropped = 0
        self.engines: dict[int, dict[str, float]] = {}  # the engines' counters (TierStats.engines)
        self.tree.tier_dropped = self._node_dropped
        #: a promotion may take a slot on another instance than the copy's when its own
        #: has none to give: where one transfer engine writes every slab (co-located
        #: slabs; the simulator's GPUs of one node)
        self.promote_anywhere = pool.config.shared_memory

    # -------------------------------------------------------------- writes
    def committed(self, key: SegmentKey, instance: int) -> None:
        """Segment ``key`` is stored in all layers on ``instance``: write it through,
        unless a tier holds it already or ``instance``'s tier has no room (every copy
        there needed by a child held only in the tier)."""
        node = self.tree.node(key)
        if node.tier is not None or key in self._staging or not self._make_room(instance):
            return
        rep = node.replica(instance)
        self._set(node, instance, rep.last_access)
        self._staging[key] = instance
        self.tree.lease([key])  # the slot stays as it is until it is staged
        write = TierWrite(key, rep.slot, node.parent, node.index, self.tree.tokens(key))
        self._ops_of(instance).writes.append(write)

    def take_ops(self) -> dict[int, TierOps]:
        """The data moves queued since the last call, per instance (drops first)."""
        ops, self._ops = self._ops, {}
        return ops

    def staged(self, writes: Iterable[SegmentKey], refused: Iterable[SegmentKey] = ()) -> None:
        """The transfer engines took copies of ``writes`` (they are written in the
        background) and refused ``refused`` (no room to stage: the copy is forgotten).
        Either way the slot is free to change again. Segments that went meanwhile (an
        instance failed) are skipped."""
        for key, ok in itertools.chain(((k, True) for k in writes), ((k, False) for k in refused)):
            if self._staging.pop(key, None) is None or key not in self.tree:
                continue
            self.tree.unlease([key])
            if ok:
                self.written += 1
            else:
                self._clear(self.tree.node(key))

    def settle(self) -> None:
        """Counts every queued write-through as staged (no data plane: the simulator)."""
        ops = self.take_ops()
        self.staged(w.key for op in ops.values() for w in op.writes)

    # ---------------------------------------------------------- eviction
    def demoted(self, key: SegmentKey, last_access: float) -> None:
        """``key``'s last replica left the slabs and it stayed, held only in the tier;
        its copy is stamped with the replica's last access."""
        node = self.tree.node(key)
        self._set(node, node.tier, last_access)
        self.demotions += 1

    def _make_room(self, instance: int) -> bool:
        lru = self._lru.get(instance)
        while lru is not None and len(lru) >= self.slots:
            victim = next((self.tree.node(e[3]) for e in lru
                           if not self._needed(self.tree.node(e[3]))), None)
            if victim is None:
                return False
            self._evict_copy(victim)
        return True

    def _needed(self, node: TreeNode) -> bool:
        """A copy the tier keeps: a write in flight, or a child held only in the tier."""
        return node.key in self._staging or node.n_children() > node.fast_kids

    def _evict_copy(self, node: TreeNode) -> None:
        if node.tier_only:  # a leaf of the tree: it goes with its copy
            self._remove_subtree(node.key)
        else:
            self._queue_drop(node.tier, node.key)
            self._clear(node)
            self.dropped += 1

    # ---------------------------------------------------------- promotion
    def promote(self, keys: Sequence[SegmentKey]) -> list[Promotion]:
        """Slots for segments held only in the tier (``keys`` parent first, as
        ``MatchResult.tier_keys`` gives them), on the instance that holds each copy:
        pending replicas, to be read in and then :meth:`promoted`. A slot on another
        instance is taken where the copy's has none to give and
        :attr:`promote_anywhere`. Stops at the first that is no longer held only in
        the tier or finds no slot (nothing evictable): what follows it could not be read
        anyway."""
        out: list[Promotion] = []
        pool, tree = self.pool, self.tree
        # The segment the first hangs under is a leaf of the slabs now (its child is in
        # the tier): kept while slots are taken, or a promotion could evict it and leave
        # the promoted ones under a segment held only in the tier. The ones after it
        # hang under pending replicas, which nothing evicts.
        parent = tree.node(keys[0]).parent if keys and keys[0] in tree else None
        guard = [parent] if parent in tree and tree.node(parent).replicas else []
        tree.lease(guard)
        try:
            for key in keys:
                node = tree.node(key) if key in tree else None
                if node is None or not node.tier_only:
                    break
                up = node.parent
                if node.index > 0 and not (up in tree and tree.node(up).replicas):
                    break  # its parent is not in a slab (not even pending): not readable
                inst = target = node.tier
                slot = pool.slots.allocate(inst)
                if slot is None and pool.evict_one(inst) is not None:
                    slot = pool.slots.allocate(inst)
                if slot is None and self.promote_anywhere:
                    try:  # where place() would put it: the home, the ring, an eviction
                        loc = pool._take_slot(key)[0]
                        target, slot = loc.instance, loc.slot
                    except CapacityError:
                        pass
                if slot is None:
                    break
                tree.add_replica(key, target, slot, pool.clock())
                out.append(Promotion(key, inst, slot, -1 if target == inst else target,
                                     node.replica(target)))
                self._reading[id(out[-1])] = out[-1]
        finally:
            tree.unlease(guard)
        return out

    def read_over(self, p: Promotion, epoch: int | None) -> None:
        """``p``'s read ended: answered or never sent (``epoch`` None), or unanswered
        (sent at ``epoch``). If its target left meanwhile (a co-located peer), the slot
        kept for it there (:meth:`forget_instance`) is freed, or held until the reader
        is fenced."""
        self._reading.pop(id(p), None)
        loc = (p.to, p.slot, _IN_FLIGHT)
        for table in (self._held_gone, self._held_back):
            if loc in table.get(p.instance, ()):
                table[p.instance].remove(loc)
                if epoch is not None:
                    table[p.instance].append((p.to, p.slot, epoch))
                elif table is self._held_back:  # taken again when its instance joined
                    self.pool.slots.free(p.to, p.slot)
                return

    def _own(self, p: Promotion) -> bool:
        """Whether ``p``'s pending replica is still in the tree (not gone with an
        ancestor whose copy failed, nor with its instance; read without the control
        plane's lock, a promotion may find its segment gone, or stored again since)."""
        return p.key in self.tree and self.tree.node(p.key).replica(p.to) is p.replica

    def promoted(self, p: Promotion) -> None:
        """``p``'s file is in its slot: the replica is ready."""
        if self._own(p):
            now = self.pool.clock()
            self.tree.set_ready(p.key, p.to, now)
            node = self.tree.node(p.key)
            if node.tier is not None:
                self._set(node, node.tier, now)
            self.promotions += 1

    def unpromote(self, p: Promotion) -> None:
        """``p`` was not read (its batch failed before): its pending replica goes, the
        segment is held only in the tier again. Children first."""
        if self._own(p):
            self.pool.slots.free(p.to, self.tree.remove_replica(p.key, p.to))

    def promotion_failed(self, p: Promotion) -> None:
        """``p``'s file was missing or corrupt: the segment goes, with what follows it
        (held only in the tier, or being promoted after it); their slots are freed."""
        if self._own(p):
            self._remove_subtree(p.key)
            self.failed_promotions += 1

    def hold_back(self, p: Promotion, epoch: int) -> None:
        """``p``'s read (sent at ``epoch`` of its reading instance) got no answer and its
        engine was not fenced: its slot stays taken, named by no replica, until
        :meth:`release` says a higher epoch is fenced (call before the batch's
        :meth:`promotion_failed`, which then leaves that slot alone). A promotion whose
        replica went already (its instance left) holds nothing."""
        if self._own(p):
            self._held_back.setdefault(p.instance, []).append((p.to, p.slot, epoch))

    def release(self, instance: int, fenced: int | None = None) -> None:
        """``instance``'s engine answered a fence of epoch ``fenced`` (None: it is
        stopped): the slots its reads of lower epochs held are free."""
        keep = []
        for inst, slot, epoch in self._held_back.pop(instance, ()):
            if fenced is None or epoch < fenced:
                self.pool.slots.free(inst, slot)
            else:
                keep.append((inst, slot, epoch))
        if keep:
            self._held_back[instance] = keep
        gone = [loc for loc in self._held_gone.pop(instance, ()) if fenced is not None and loc[2] >= fenced]
        if gone:
            self._held_gone[instance] = gone

    def held_back(self) -> list[tuple[int, int]]:
        return [(inst, slot) for locs in self._held_back.values() for inst, slot, _ in locs]

    def adopt(self, listings: Mapping[int, Sequence[tuple]]) -> int:
        """Copies the instances' tiers held before this control plane began (the pool
        started again on the same directories, or a new control process): per instance,
        ``(key, parent, index, tokens)`` each, least recently used first. Each goes into
        the tree held only in the tier (a segment already there gains the copy), parent
        first over all the instances (a document's segments lie in several), while it
        has its place (its parent in the tree, or a root) and its tier has room; the
        others' copies are dropped, and so is every copy whose key is not the hash of
        its parent and tokens in this pool's namespace (another model's or layout's, or
        a header not written for it). Returns how many were adopted; they count as older
        than anything written from now on."""
        tree, hasher, now = self.tree, self.pool.hasher, self.pool.clock()
        items = []
        for instance, entries in listings.items():
            self._lru.setdefault(instance, SortedList())
            n = len(entries)
            items += [(entry[2], instance, now - (n - order) * 1e-6, entry)
                      for order, entry in enumerate(entries)]
        adopted = 0
        for _index, instance, stamp, (key, parent, index, tokens) in sorted(items, key=lambda it: it[0]):
            if key in tree and tree.node(key).tier == instance:
                continue  # listed twice: adopted already
            ok = (len(self._lru[instance]) < self.slots and tokens is not None
                  and len(tokens) == 4 * hasher.segment_tokens
                  and hasher.keys(tokens, parent=parent) == [key])
            if ok and key in tree:
                ok = tree.node(key).tier is None  # else a copy elsewhere: this one goes
            elif ok:
                try:
                    tree.insert(key, parent, index, tokens)
                except (ValueError, KeyError):  # no place for it (its parent is gone)
                    ok = False
            if ok:
                self._set(tree.node(key), instance, stamp)
                adopted += 1
            else:
                self._queue_drop(instance, key)
        return adopted

    # ------------------------------------------------------------ instances
    def forget_instance(self, instance: int) -> None:
        """``instance`` leaves the pool: the copies in its tier are forgotten, and the
        segments held only there go (with their subtrees)."""
        for entry in list(self._lru.get(instance, ())):
            key = entry[3]
            if key not in self.tree:
                continue
            node = self.tree.node(key)
            if node.tier_only:
                self._remove_subtree(key)
            else:
                self._clear(node)
        self._lru.pop(instance, None)
        self._ops.pop(instance, None)
        for key in [k for k, i in self._staging.items() if i == instance]:
            self.staged((), (key,))
        self.release(instance)  # its engines are stopped: they write nothing more
        for reader, locs in self._held_back.items():  # its slots go with it, but a
            # stalled reader may still write there: taken again if it joins again
            self._held_gone.setdefault(reader, []).extend(loc for loc in locs if loc[0] == instance)
            self._held_back[reader] = [loc for loc in locs if loc[0] != instance]
        for p in list(self._reading.values()):  # a peer's read into its slab, still running
            if p.to == instance and p.instance != instance:
                self._held_gone.setdefault(p.instance, []).append((instance, p.slot, _IN_FLIGHT))

    def instance_added(self, instance: int) -> None:
        """``instance`` joins (again, on the memory its slab had: a co-located slab is
        zeroed and reused): the slots there that an unfenced reader's late read may still
        write are taken again, held back until that reader is fenced."""
        for reader in list(self._held_gone):
            mine = [loc for loc in self._held_gone[reader] if loc[0] == instance]
            if not mine:
                continue
            self._held_gone[reader] = [loc for loc in self._held_gone[reader] if loc[0] != instance]
            taken = []
            for loc in mine:
                try:
                    self.pool.slots.take(loc[0], loc[1])
                except ValueError:  # beyond a smaller slab: no slot to guard
                    continue
                taken.append(loc)
            self._held_back.setdefault(reader, []).extend(taken)

    # -------------------------------------------------------------- stats
    def stats(self) -> TierStats:
        return TierStats({i: len(lru) for i, lru in self._lru.items()}, self.slots, self.written,
                         self.demotions, self.promotions, self.failed_promotions, self.dropped,
                         {i: dict(c) for i, c in self.engines.items()})

    def check(self) -> None:
        """Asserts the rules of the module docstring (for tests)."""
        indexed = {e[3]: i for i, lru in self._lru.items() for e in lru}
        assert sum(len(lru) for lru in self._lru.values()) == len(indexed), "a copy indexed twice"
        assert all(len(lru) <= self.slots for lru in self._lru.values()), "a tier over capacity"
        for key in self.tree.keys():
            node = self.tree.node(key)
            assert indexed.pop(key, None) == node.tier, "tier index out of date"
            if node.tier_only:
                assert all(k.tier_only for k in node.child_nodes()), "a slab segment under the tier"
            if key in self._staging:
                assert node.leases and node.tier == self._staging[key], "a write-through unleased"
        assert not indexed, "the tier index names a segment not in the tree"

    # ------------------------------------------------------------ internals
    def _remove_subtree(self, key: SegmentKey) -> None:
        """Drops ``key`` and what follows it, freeing the slots of their replicas (those
        held back for an unanswered read stay taken)."""
        held = set(self.held_back())
        for _key, inst, slot in self.tree.remove_subtree(key):
            if (inst, slot) not in held:
                self.pool.slots.free(inst, slot)

    def _ops_of(self, instance: int) -> TierOps:
        return self._ops.setdefault(instance, TierOps())

    def _queue_drop(self, instance: int, key: SegmentKey) -> None:
        # A write of the same key queued before stays: the file it makes holds this
        # key's segment (keys name their content), at worst a copy no node names.
        self._ops_of(instance).drops.append(key)

    def _set(self, node: TreeNode, instance: int, stamp: float) -> None:
        """Indexes ``node``'s copy on ``instance`` at ``stamp`` (again, if indexed)."""
        if node.tier_entry is not None:
            self._lru[node.tier].remove(node.tier_entry)
        node.tier = instance
        node.tier_entry = (stamp, -node.index, next(self._seq), node.key)
        self._lru.setdefault(instance, SortedList()).add(node.tier_entry)

    def _clear(self, node: TreeNode) -> None:
        if node.tier_entry is not None:
            self._lru[node.tier].remove(node.tier_entry)
        node.tier = node.tier_entry = None

    def _node_dropped(self, node: TreeNode) -> None:
        """The tree dropped ``node`` with a copy in a tier: the file goes too, and a
        write-through not yet handed out is forgotten (its slot is freed now, and may
        hold another segment by the time the write would run)."""
        self._staging.pop(node.key, None)  # its lease went with it
        ops = self._ops.get(node.tier)
        if ops is not None and ops.writes:
            ops.writes = [w for w in ops.writes if w.key != node.key]
        if node.tier in self._lru:  # not an instance being forgotten
            self._queue_drop(node.tier, node.key)
            self.dropped += 1
        self._clear(node)

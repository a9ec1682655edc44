"""Property tests of :class:`tokenlake.core.pool.CachePool` against a reference model.

:class:`PoolMachine` runs random sequences of inserts (``place`` of every full segment,
then ``commit``), matches, leases, pins, second replicas (directly through the slot pool
and the tree, and through ``rebalance``), evictions, private tails and instance removals
on a tiny pool (3 slots per instance, so eviction and ``CapacityError`` are frequent),
with an injected clock that often stands still (LRU ties). After every step the pool must
agree exactly with a model made of plain dicts, and:

* a pinned or leased segment is never lost unless an instance was removed;
* no orphaned suffix (``tree.check()`` also checks the LRU index);
* slot accounting is exact: ``used(i)`` = replicas on i + private slots on i, no slot
  held twice, every slot below capacity;
* the LRU victim is evictable and has the least (last access, deeper first) key;
* ``CapacityError`` comes exactly when no slot is free and nothing is evictable, and
  leaves the pool unchanged;
* ``match`` is the longest prefix of ready segments.

The regression tests at the end pin down the library bugs these properties found.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import Counter
from collections.abc import Collection

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pool_state import pool_state
from reference_model import MNode, MReplica, NodeModel

from tokenlake.core.config import PoolConfig
from tokenlake.core.errors import CapacityError, ConfigError, PrefixNotCached, SegmentNotFound
from tokenlake.core.placement import plan_replication
from tokenlake.core.pool import CachePool, Eviction
from tokenlake.core.prefix_tree import SegmentLocation
from tokenlake.core.segments import token_bytes

C = 2
CAPACITY = 3
# Prefixes of a few documents that share prefixes, plus a random tail: most chains overlap.
DOCS = ([0] * 8, [0, 0, 1, 1, 2, 2, 0, 1], [1, 2] * 4, [0, 0, 0, 0, 2, 2, 2, 2])
TOKENS = st.builds(
    lambda doc, n, tail: doc[:n] + tail,
    st.sampled_from(DOCS),
    st.integers(0, 8),
    st.lists(st.integers(0, 2), max_size=3),
)
DT = st.sampled_from([0.0, 0.0, 0.5, 1.0, 4.0])


def make_pool(slots: int = CAPACITY, instances=(0, 1, 2), now=None,
              eviction_choices: int = 2, shared_memory: bool = False) -> tuple[CachePool, list]:
    clock = now if now is not None else [0.0]
    cfg = PoolConfig(segment_tokens=C, namespace="pool-props", slots_per_instance=slots, vnodes=8,
                     eviction_choices=eviction_choices, shared_memory=shared_memory)
    return CachePool(cfg, list(instances), lambda: clock[0], random.Random(0)), clock


# ------------------------------------------------------------------- the model


class PoolModel(NodeModel):
    """Nodes, private slots and capacities as plain dicts; everything else recomputed."""

    def __init__(self, capacity: dict[int, int]) -> None:
        super().__init__()
        self.private: dict[tuple[int, int], str] = {}
        self.capacity = dict(capacity)

    def used_slots(self, inst: int) -> list[int]:
        reps = [n.replicas[inst].slot for n in self.nodes.values() if inst in n.replicas]
        return reps + [s for (i, s) in self.private if i == inst]

    def free(self, inst: int) -> int:
        return self.capacity[inst] - len(self.used_slots(inst))

    def lru_candidates(self, protect: bytes | None = None,
                       instances: Collection[int] | None = None) -> list[tuple[bytes, int]]:
        ev = [v for v in self.evictable(protect) if instances is None or v[1] in instances]
        if not ev:
            return []
        best = min(self.lru_order(v) for v in ev)
        return [v for v in ev if self.lru_order(v) == best]

    def drop_replica(self, key: bytes, inst: int) -> None:
        node = self.nodes[key]
        del node.replicas[inst]
        if not node.replicas:
            assert not self.children(key), "model would orphan a suffix"
            del self.nodes[key]


# ------------------------------------------------------------- state machine


class PoolMachine(RuleBasedStateMachine):
    eviction_choices = 2  # a full pool evicts at the home or the next instance on the ring

    @initialize()
    def setup(self):
        self.pool, self.clock = make_pool(eviction_choices=self.eviction_choices)
        self.tree = self.pool.tree
        self.model = PoolModel({i: CAPACITY for i in self.pool.instances})
        self.next_instance = itertools.count(3)
        self.pending: list[tuple[bytes, int]] = []  # uncommitted replicas we may commit/abort
        self.sealed: dict[tuple[bytes, int, int], str] = {}  # sealed private slot -> owner
        self.pins: list[tuple[bytes, ...]] = []
        self.leases: list[tuple[bytes, ...]] = []
        self.copies: list = []  # Replications started by rebalance, not finished
        self.evictions = 0
        self.protected: set[bytes] = set()
        self.removed_instance = False

    @property
    def now(self) -> float:
        return self.clock[0]

    # ------------------------------------------------------------ helpers
    def expect_take(self, ring_key: bytes, protect: bytes | None):
        """What ``_take_slot`` must do: ('free', instance), ('evict', candidates) or
        'full': the home if free, else the first free instance in ring order, else the
        least recently used evictable replica on the first ``eviction_choices``
        instances in ring order, else the pool's."""
        pref = list(self.pool.ring.preference(ring_key))
        assert sorted(pref) == sorted(self.model.capacity)
        for inst in pref:
            if self.model.free(inst) > 0:
                return "free", inst
        cands = self.model.lru_candidates(protect, pref[: self.pool.config.eviction_choices]) \
            or self.model.lru_candidates(protect)
        return ("evict", cands) if cands else ("full", None)

    def took(self, expect, loc: SegmentLocation, evicted) -> None:
        """Checks (and applies to the model) a slot that ``_take_slot`` handed out, and
        the eviction record that came with it."""
        kind, what = expect
        if kind == "free":
            assert loc.instance == what  # first instance in ring order with a free slot
            assert evicted is None
        else:
            victims = [
                (k, i)
                for k, n in self.model.nodes.items()
                for i, r in n.replicas.items()
                if (i, r.slot) == (loc.instance, loc.slot)
            ]
            assert len(victims) == 1 and victims[0] in what, (victims, what)
            self.check_eviction(evicted, *victims[0])
            self.model.drop_replica(*victims[0])
            self.evictions += 1
        assert 0 <= loc.slot < self.model.capacity[loc.instance]
        assert loc.slot not in self.model.used_slots(loc.instance)

    def check_eviction(self, evicted, key: bytes, inst: int) -> None:
        """The pool's eviction record names exactly the replica the model evicts."""
        node, rep = self.model.nodes[key], self.model.nodes[key].replicas[inst]
        assert evicted == Eviction(key, node.parent, node.index, inst, rep.slot, rep.last)

    def forget(self, gone: set[bytes]) -> None:
        def strip(chains):
            return [t for t in (tuple(k for k in c if k not in gone) for c in chains) if t]

        self.pins, self.leases = strip(self.pins), strip(self.leases)
        self.pending = [(k, i) for k, i in self.pending if k not in gone]

    def commit(self, key: bytes, inst: int) -> None:
        self.pool.commit(key, inst)
        rep = self.model.nodes[key].replicas[inst]
        rep.ready, rep.last = True, self.now

    def live_pending(self) -> list[tuple[bytes, int]]:
        self.pending = [
            (k, i)
            for k, i in self.pending
            if k in self.model.nodes
            and i in self.model.nodes[k].replicas
            and not self.model.nodes[k].replicas[i].ready
        ]
        self.sealed = {
            (k, i, slot): o
            for (k, i, slot), o in self.sealed.items()
            if (k, i) in self.pending and self.model.nodes[k].replicas[i].slot == slot
        }
        return self.pending

    # -------------------------------------------------------------- rules
    @rule(dt=DT)
    def advance(self, dt):
        self.clock[0] += dt

    @rule(tokens=TOKENS, data=st.data())
    def insert(self, tokens, data):
        """``place`` every full segment, then ``commit`` the new ones (some stay pending)."""
        parent, created = None, []
        for i, key in enumerate(self.pool.hasher.keys(tokens)):
            if key in self.model.nodes:
                placed = self.pool.place(key, parent, i)
                loc = placed.location
                assert not placed.created and placed.evicted is None
                reps = self.model.nodes[key].replicas
                ready = sorted(j for j, r in reps.items() if r.ready)
                assert loc.instance == (ready or sorted(reps))[0]
                assert loc.slot == reps[loc.instance].slot
            else:
                expect = self.expect_take(key, protect=parent)
                event(f"place: {expect[0]}")
                if expect[0] == "full":
                    with pytest.raises(CapacityError):
                        self.pool.place(key, parent, i)
                    break
                placed = self.pool.place(key, parent, i)
                loc = placed.location
                assert placed.created
                self.took(expect, loc, placed.evicted)
                node = self.model.nodes[key] = MNode(parent, i)
                node.replicas[loc.instance] = MReplica(loc.slot, False, self.now)
                created.append((key, loc.instance))
            parent = key
        for key, inst in created:
            if data.draw(st.integers(0, 4)):
                self.commit(key, inst)
            else:
                self.pending.append((key, inst))

    @rule(data=st.data())
    def commit_pending(self, data):
        live = self.live_pending()
        if live:
            key, inst = live.pop(data.draw(st.integers(0, len(live) - 1)))
            self.commit(key, inst)

    @rule(data=st.data())
    def abort_pending(self, data):
        live = self.live_pending()
        if not live:
            return
        key, inst = live[data.draw(st.integers(0, len(live) - 1))]
        node = self.model.nodes[key]
        slot = node.replicas[inst].slot
        owner = self.sealed.get((key, inst, slot))
        unseal = owner is not None and data.draw(st.booleans())
        if len(node.replicas) == 1 and (self.model.children(key) or node.pins or node.leases):
            with pytest.raises(ValueError):
                if unseal:
                    self.pool.unseal(key, SegmentLocation(inst, slot), owner)
                else:
                    self.pool.abort(key, inst)
            return
        live.remove((key, inst))
        self.model.drop_replica(key, inst)
        if unseal:  # the plan that sealed a private tail failed: the tail is private again
            self.pool.unseal(key, SegmentLocation(inst, slot), owner)
            self.model.private[(inst, slot)] = owner
        else:
            self.pool.abort(key, inst)

    @rule(tokens=TOKENS, data=st.data())
    def seal_private(self, data, tokens):
        """A private tail fills up and becomes the next segment of a cached chain."""
        if not self.model.private:
            return
        keys = self.pool.hasher.keys(tokens)
        i = next((j for j, k in enumerate(keys) if k not in self.model.nodes), None)
        if i is None:
            return
        key, parent = keys[i], keys[i - 1] if i else None
        inst, slot = data.draw(st.sampled_from(sorted(self.model.private)))
        self.pool.seal_private(SegmentLocation(inst, slot), key, parent, i)
        with pytest.raises(ValueError):  # already cached now: dedup instead
            self.pool.seal_private(SegmentLocation(inst, slot), key, parent, i)
        owner = self.model.private.pop((inst, slot))
        node = self.model.nodes[key] = MNode(parent, i)
        node.replicas[inst] = MReplica(slot, False, self.now)
        self.pending.append((key, inst))
        self.sealed[(key, inst, slot)] = owner

    @rule(tokens=TOKENS, cap=st.none() | st.integers(0, 4 * C + 1), raw=st.booleans())
    def match(self, tokens, cap, raw):
        m = self.pool.match(token_bytes(tokens) if raw else tokens, max_tokens=cap)
        limit = len(tokens) if cap is None else min(cap, len(tokens))
        want = self.model.match(self.pool.hasher.keys(tokens[: limit // C * C]))
        assert list(m.keys) == want and m.hit_tokens == C * len(want)
        event(f"match: {len(want)} segments")
        for key, locs in zip(m.keys, m.replicas):
            reps = self.model.nodes[key].replicas
            assert {(x.instance, x.slot) for x in locs} == {
                (i, r.slot) for i, r in reps.items() if r.ready
            }

    @rule(tokens=TOKENS)
    def lease_match(self, tokens):
        m = self.pool.match(tokens)
        if m.keys:
            self.tree.lease(m.keys)
            for k in m.keys:
                self.model.nodes[k].leases += 1
            self.leases.append(m.keys)

    @rule(data=st.data())
    def unlease(self, data):
        """Release a lease; like ``finish_request``, the chosen replicas are touched first."""
        if not self.leases:
            return
        keys = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        for k in keys:
            ready = sorted(i for i, r in self.model.nodes[k].replicas.items() if r.ready)
            if ready:
                inst = data.draw(st.sampled_from(ready))
                self.tree.touch(k, inst, self.now)
                rep = self.model.nodes[k].replicas[inst]
                rep.last = max(rep.last, self.now)
        self.tree.unlease(keys)
        for k in keys:
            self.model.nodes[k].leases -= 1

    @rule(tokens=TOKENS)
    def pin(self, tokens):
        keys = self.pool.hasher.keys(tokens)
        hit = self.model.match(keys)
        if len(hit) < len(keys):
            with pytest.raises(PrefixNotCached):
                self.pool.pin(tokens)
            return
        m = self.pool.pin(tokens)
        assert list(m.keys) == hit
        for k in hit:
            self.model.nodes[k].pins += 1
        if hit:
            self.pins.append(tuple(hit))

    @rule(data=st.data())
    def unpin(self, data):
        if self.pins:
            keys = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
            self.pool.unpin(keys)
            for k in keys:
                self.model.nodes[k].pins -= 1

    @rule(data=st.data())
    def add_second_replica(self, data):
        """A copy made by hand: a slot from the slot pool, a pending replica in the tree."""
        options = [
            (k, i)
            for k, n in self.model.nodes.items()
            if any(r.ready for r in n.replicas.values())
            for i in sorted(self.model.capacity)
            if i not in n.replicas and self.model.free(i) > 0
        ]
        if not options:
            return
        key, inst = data.draw(st.sampled_from(sorted(options)))
        slot = self.pool.slots.allocate(inst)
        assert slot is not None and slot not in self.model.used_slots(inst)
        self.tree.add_replica(key, inst, slot, self.now)
        self.model.nodes[key].replicas[inst] = MReplica(slot, False, self.now)
        if data.draw(st.booleans()):
            self.commit(key, inst)
        else:
            self.pending.append((key, inst))

    @rule()
    def evict(self):
        cands = self.model.lru_candidates()
        victim = self.tree.lru_victim()
        evicted = self.pool.evict_one()
        assert (evicted is not None) == bool(cands)
        if cands:
            assert victim in cands
            self.check_eviction(evicted, *victim)
            self.model.drop_replica(*victim)
            self.evictions += 1

    @rule(n=st.integers(1, 4))
    def evict_and_restore(self, n):
        """Evictions put back (newest first) leave the pool exactly as it was."""
        before = pool_state(self.pool)
        evicted = [e for e in (self.pool.evict_one() for _ in range(n)) if e is not None]
        event(f"evict_and_restore: {len(evicted)}")
        self.pool.restore_evicted(evicted)
        assert pool_state(self.pool) == before

    @rule(owner=st.sampled_from("abc"), hint=st.binary(max_size=3))
    def allocate_private(self, owner, hint):
        expect = self.expect_take(hashlib.blake2b(hint, digest_size=16).digest(), protect=None)
        event(f"private: {expect[0]}")
        if expect[0] == "full":
            with pytest.raises(CapacityError):
                self.pool.allocate_private(owner, hint)
            return
        placed = self.pool.allocate_private(owner, hint)
        loc = placed.location
        assert placed.created
        self.took(expect, loc, placed.evicted)
        self.model.private[(loc.instance, loc.slot)] = owner

    @rule(data=st.data())
    def release_private(self, data):
        if not self.model.private:
            with pytest.raises(SegmentNotFound):
                self.pool.release_private(SegmentLocation(min(self.model.capacity), 0))
            return
        inst, slot = data.draw(st.sampled_from(sorted(self.model.private)))
        self.pool.release_private(SegmentLocation(inst, slot))
        del self.model.private[(inst, slot)]
        with pytest.raises(SegmentNotFound):
            self.pool.release_private(SegmentLocation(inst, slot))

    @rule(tokens=TOKENS, reads=st.integers(1, 6))
    def rebalance(self, tokens, reads):
        """Reads of a cached chain, then heavy-hitter replication."""
        m = self.pool.match(tokens)
        if m.keys:
            served = Counter(locs[0].instance for locs in m.replicas)
            for _ in range(reads):
                self.pool.record_access([(m.keys, served)])
        started = self.pool.rebalance()
        event(f"rebalance: {min(len(started), 2)} copies")
        targets = set()
        for rep in started:
            node = self.model.nodes[rep.key]
            assert node.replicas[rep.source.instance].ready
            assert node.replicas[rep.source.instance].slot == rep.source.slot
            t = rep.target
            assert t.instance not in node.replicas and (rep.key, t.instance) not in targets
            targets.add((rep.key, t.instance))
            assert 0 <= t.slot < self.model.capacity[t.instance]
            if t.slot in self.model.used_slots(t.instance):
                # A full target made room: its least recently used evictable replica went.
                assert self.model.free(t.instance) == 0
                cands = self.model.lru_candidates(instances=(t.instance,))
                victims = [(k, i) for k, n in self.model.nodes.items()
                           for i, r in n.replicas.items() if (i, r.slot) == (t.instance, t.slot)]
                assert len(victims) == 1 and victims[0] in cands and victims[0][0] != rep.key
                self.model.drop_replica(*victims[0])
                self.evictions += 1
                event("rebalance: evicted on the target")
            node.replicas[t.instance] = MReplica(t.slot, False, self.now)
            node.leases += 1  # the source is kept until the copy is done
            self.copies.append(rep)

    @rule(data=st.data(), finish=st.booleans())
    def end_copy(self, data, finish):
        if not self.copies:
            return
        rep = self.copies.pop(data.draw(st.integers(0, len(self.copies) - 1)))
        node = self.model.nodes[rep.key]
        node.leases -= 1
        if finish:
            self.pool.finish_replication(rep)
            r = node.replicas[rep.target.instance]
            r.ready, r.last = True, self.now
        else:
            self.pool.abort_replication(rep)
            self.model.drop_replica(rep.key, rep.target.instance)

    @precondition(lambda self: len(self.model.capacity) > 1)
    @rule(data=st.data())
    def remove_instance(self, data):
        gone_inst = data.draw(st.sampled_from(sorted(self.model.capacity)))
        model = self.model
        keep = []
        for rep in self.copies:  # copies from or to the instance are aborted first
            if gone_inst in (rep.source.instance, rep.target.instance):
                model.nodes[rep.key].leases -= 1
                model.drop_replica(rep.key, rep.target.instance)
            else:
                keep.append(rep)
        roots = [k for k, n in model.nodes.items() if set(n.replicas) == {gone_inst}]
        removed = set().union(*(model.subtree(k) for k in roots))
        for k in removed:
            del model.nodes[k]
        for n in model.nodes.values():
            n.replicas.pop(gone_inst, None)
        lost = sorted(o for (i, _), o in model.private.items() if i == gone_inst)
        model.private = {loc: o for loc, o in model.private.items() if loc[0] != gone_inst}
        del model.capacity[gone_inst]
        self.copies = [r for r in keep if r.key not in removed]
        self.forget(removed)

        out = self.pool.remove_instance(gone_inst)
        event(f"remove_instance: {min(len(removed), 3)} segments gone")
        assert out.instance == gone_inst
        assert len(out.removed_keys) == len(set(out.removed_keys))
        assert set(out.removed_keys) == removed
        assert sorted(out.lost_private) == lost
        assert gone_inst not in self.pool.instances
        assert gone_inst not in self.pool.ring.instances
        with pytest.raises(ConfigError):
            self.pool.remove_instance(gone_inst)
        self.removed_instance = True

    @precondition(lambda self: len(self.model.capacity) < 4)
    @rule()
    def add_instance(self):
        inst = next(self.next_instance)
        self.pool.add_instance(inst)
        self.model.capacity[inst] = CAPACITY

    # --------------------------------------------------------- invariants
    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "model"):
            return
        pool, tree, model = self.pool, self.tree, self.model
        pool.check()  # the tree's invariants, exact slot accounting, copies in flight
        assert set(tree.keys()) == set(model.nodes)
        for key, node in model.nodes.items():
            assert node.parent is None or node.parent in model.nodes
            assert tree.parent(key) == node.parent and tree.index(key) == node.index
            locs = tree.replicas(key, ready_only=False)
            assert {x.instance: x.slot for x in locs} == {
                i: r.slot for i, r in node.replicas.items()
            }
            assert {x.instance for x in tree.replicas(key)} == {
                i for i, r in node.replicas.items() if r.ready
            }
            assert tree.is_pinned(key) == (node.pins > 0)
            assert tree.lease_count(key) == node.leases
        assert pool._private == model.private  # white-box: owners of private slots
        # Slot accounting.
        assert set(pool.instances) == set(model.capacity)
        for inst, cap in model.capacity.items():
            used = model.used_slots(inst)
            assert len(used) == len(set(used)), f"slot held twice on {inst}"
            assert all(0 <= s < cap for s in used)
            assert pool.slots.capacity(inst) == cap
            assert pool.slots.used(inst) == len(used)
            assert not set(used) & pool.slots._free_set[inst]  # white-box: free list exact
        assert pool.slots.total_free() == sum(
            cap - len(model.used_slots(inst)) for inst, cap in model.capacity.items())
        # Eviction order.
        cands = model.lru_candidates()
        assert tree.evictable_count() == len(model.evictable())
        assert tree.lru_victim() in cands if cands else tree.lru_victim() is None
        # Counters.
        stats = pool.stats()
        assert stats.segments == len(model.nodes)
        assert stats.replicas == sum(len(n.replicas) for n in model.nodes.values())
        assert stats.private_slots == len(model.private)
        assert stats.evictions == self.evictions

    @invariant()
    def protected_segments_survive(self):
        if not hasattr(self, "model"):
            return
        if not self.removed_instance:
            for key in self.protected:
                assert key in self.tree and self.tree.replicas(key, ready_only=False)
        self.removed_instance = False
        self.protected = {k for k, n in self.model.nodes.items() if n.pins or n.leases}


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=100, stateful_step_count=100, deadline=None)


class HomeOnlyPoolMachine(PoolMachine):
    eviction_choices = 1  # a full pool evicts at the home only


TestHomeOnlyPoolMachine = HomeOnlyPoolMachine.TestCase
TestHomeOnlyPoolMachine.settings = settings(max_examples=40, stateful_step_count=100, deadline=None)


# ------------------------------------------------------- regression tests


def test_place_never_evicts_the_parent_it_extends():
    pool, clock = make_pool(slots=1, instances=[0])
    k0, k1 = pool.hasher.keys([1, 2, 3, 4])
    pool.place(k0, None, 0)
    pool.commit(k0, 0)  # k0: a ready, unpinned leaf, the only evictable replica
    with pytest.raises(CapacityError):
        pool.place(k1, k0, 1)
    assert k0 in pool.tree and k1 not in pool.tree and pool.slots.used(0) == 1
    pool.tree.check()

    pool, clock = make_pool(slots=1, instances=[0, 1])
    x = pool.hasher.keys([9, 9])[0]
    pool.place(k0, None, 0)
    pool.commit(k0, pool.tree.replicas(k0, ready_only=False)[0].instance)
    clock[0] = 1.0
    pool.place(x, None, 0)
    pool.commit(x, pool.tree.replicas(x, ready_only=False)[0].instance)
    clock[0] = 2.0
    placed = pool.place(k1, k0, 1)  # k0 is the LRU leaf, but x must go instead
    assert placed.created and x not in pool.tree and k0 in pool.tree
    assert (placed.evicted.key, placed.evicted.parent, placed.evicted.last_access) == (x, None, 1.0)
    assert pool.tree.parent(k1) == k0 and pool.tree.lease_count(k0) == 0
    pool.tree.check()


def test_place_rejects_a_bad_parent_or_index_without_taking_a_slot():
    pool, _ = make_pool(slots=2, instances=[0])
    k0, k1, k2 = pool.hasher.keys([1, 2, 3, 4, 5, 6])
    with pytest.raises(SegmentNotFound):
        pool.place(k1, k0, 1)
    with pytest.raises(ValueError):
        pool.place(k0, None, 1)
    pool.place(k0, None, 0)
    with pytest.raises(ValueError):
        pool.place(k2, k0, 2)
    assert pool.slots.used(0) == 1 and len(pool.tree) == 1


def test_commit_again_moves_the_replica_in_lru_order():
    pool, clock = make_pool(slots=4, instances=[0])
    a, b = (pool.hasher.keys(t)[0] for t in ([1, 1], [2, 2]))
    for key in (a, b):
        pool.place(key, None, 0)
        pool.commit(key, 0)
        clock[0] += 1
    pool.commit(a, 0)  # a is accessed again (a second commit of the same replica)
    pool.tree.check()
    assert pool.tree.lru_victim() == (b, 0)


def test_match_of_raw_token_bytes_honours_max_tokens():
    pool, _ = make_pool(slots=4, instances=[0])
    tokens = [1, 2, 3, 4, 5, 6]
    keys = pool.hasher.keys(tokens)
    for i, key in enumerate(keys):
        pool.place(key, keys[i - 1] if i else None, i)
        pool.commit(key, 0)
    raw = token_bytes(tokens)
    for cap in (None, 0, 1, 2, 3, 5, 6, 7):
        assert pool.match(raw, max_tokens=cap) == pool.match(tokens, max_tokens=cap)
    assert pool.match(raw, max_tokens=4).num_segments == 2


def _put(pool, key, parent, index, inst, now=0.0):
    """Stores a ready replica of ``key`` on ``inst`` by hand (tree + slot pool)."""
    if key not in pool.tree:
        pool.tree.insert(key, parent, index)
    pool.tree.add_replica(key, inst, pool.slots.allocate(inst), now, ready=True)


def test_remove_instance_voids_copies_of_segments_it_took_along():
    pool, clock = make_pool(slots=4, instances=[0, 1, 2])
    tokens = [1, 2, 3, 4]
    k0, k1 = pool.hasher.keys(tokens)
    _put(pool, k0, None, 0, inst=0)
    _put(pool, k1, k0, 1, inst=1)
    chain, tail = (k0, k1), (k1,)
    pool.record_access([(chain, {0: 1, 1: 1}), (tail, {1: 1})] + [(tail, {1: 1})] * 4)
    (rep,) = pool.rebalance()
    assert (rep.key, rep.source.instance, rep.target.instance) == (k1, 1, 2)
    # Instance 0 fails: k0 had its only replica there, so k0 and k1 leave the tree; the
    # copy of k1 from 1 to 2 is void.
    removal = pool.remove_instance(0)
    assert sorted(removal.removed_keys) == sorted([k0, k1])
    assert pool.slots.used(1) == pool.slots.used(2) == 0
    # The prefix comes back, this time with k1 on instance 2, pinned by a request.
    _put(pool, k0, None, 0, inst=1)
    _put(pool, k1, k0, 1, inst=2)
    pool.pin(tokens)
    # Instance 2 fails: k1 is lost (and said so); the void copy must not touch it.
    removal = pool.remove_instance(2)
    assert removal.removed_keys == (k1,)
    assert pool.tree.is_pinned(k0) and k1 not in pool.tree
    pool.tree.check()


def test_a_single_hot_segment_is_replicated():
    """One hot segment alone on an instance: halving its load must be allowed."""
    key = b"k" * 16
    out = plan_replication([key], {key: 1000}, lambda _k: [0], {0: 1000.0}, list(range(4)))
    assert out and (out[0].source, out[0].target) == (0, 1)
    pool, clock = make_pool(slots=2, instances=[0, 1, 2])
    (k0,) = pool.hasher.keys([5, 5])
    _put(pool, k0, None, 0, inst=0)
    pool.record_access([((k0,), {0: 1})] * 10)
    (rep,) = pool.rebalance()
    assert rep.source.instance == 0 and rep.target.instance in (1, 2)
    pool.finish_replication(rep)
    assert len(pool.tree.replicas(k0)) == 2 and pool.tree.lease_count(k0) == 0


@pytest.mark.parametrize("shared", [False, True], ids=["hosts", "shared-memory"])
def test_a_shared_memory_pool_reads_one_replica_and_replicates_nothing(shared):
    """``PoolConfig.shared_memory`` (one machine, every slab readable by every query
    engine): every request reads the same replica of a segment, so requests sharing it
    share its slot, and a hot segment is not copied (the copy would move no work)."""
    pool, _ = make_pool(slots=2, instances=[0, 1, 2, 3], shared_memory=shared)
    (k0,) = pool.hasher.keys([5, 5])
    for inst in (2, 0, 3):
        _put(pool, k0, None, 0, inst=inst)
    locs = pool.tree.replicas(k0)
    picked = {pool.choose(locs, {0: 9.0, 2: 0.0, 3: 0.0}).instance for _ in range(40)}
    assert picked == {0} if shared else len(picked) > 1
    pool.record_access([((k0,), {0: 1})] * 10)
    assert (pool.rebalance() == []) == shared

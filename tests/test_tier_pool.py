"""The control plane's disk tier (:mod:`tokenlake.core.tier`): write-through, segments
held only in the tier, promotion, the tier's LRU, failures.

Examples first, then a stateful property test that runs random stores, matches,
promotions (some of whose files are lost), late data-plane answers, instance removals
and forced evictions on a tiny pool with a simulated data plane that records what each
slot and each tier file holds. After every step the pool's invariants hold
(``pool.check()``, with the tier's), and every ready replica's slot holds its own
segment: no step, however interleaved, lets a read see another segment's bytes.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tokenlake.core import tier_flow
from tokenlake.core.config import PoolConfig
from tokenlake.core.errors import CapacityError, ConfigError
from tokenlake.core.pool import CachePool

C = 2


def make_pool(slots=3, tier=4, instances=(0, 1)):
    clock = [0.0]
    cfg = PoolConfig(segment_tokens=C, namespace="tier", slots_per_instance=slots, vnodes=8,
                     page_tokens=C, tier_slots=tier)
    return CachePool(cfg, list(instances), lambda: clock[0], random.Random(0)), clock


def store(pool, tokens, clock=None, settle=True):
    """Places and commits every whole segment of ``tokens``, then (``settle``) counts
    their write-throughs as staged; returns their keys."""
    parent, keys = None, pool.hasher.keys(tokens)
    for i, key in enumerate(keys):
        placed = pool.place(key, parent, i, tokens[i * C:(i + 1) * C])
        if placed.created:
            pool.commit(key, placed.location.instance)
        parent = key
        if clock is not None:
            clock[0] += 1
    if settle and pool.tier is not None:
        pool.tier.settle()
    return keys


def test_evicted_segments_stay_in_the_tier_and_come_back():
    pool, clock = make_pool(slots=2, instances=(0,))
    doc = [1, 2, 3, 4]
    keys = store(pool, doc, clock)
    pool.tier.settle()
    assert all(pool.tree.node(k).tier == 0 for k in keys)
    store(pool, [7, 7, 8, 8], clock)  # fills the instance: the document leaves the slab
    pool.tier.settle()
    pool.check()
    m = pool.match(doc)
    assert m.keys == () and m.tier_keys == tuple(keys)
    assert all(pool.tree.node(k).tier_only for k in keys)
    assert pool.tier.stats().demotions == 2
    promos = pool.tier.promote(m.tier_keys)
    assert [p.key for p in promos] == list(keys)
    assert pool.match(doc).keys == ()  # pending: nothing reads them yet
    for p in promos:
        pool.tier.promoted(p)
    pool.check()
    assert pool.match(doc).keys == tuple(keys)
    assert pool.tier.stats().promotions == 2


def test_a_hot_segment_read_back_from_the_tier_is_replicated():
    """Hits on promoted segments count in the access window like any other: one that
    many requests read after its promotion is a heavy hitter and gets a replica."""
    pool, clock = make_pool(slots=2, instances=(0, 1, 2))
    (key,) = store(pool, [5, 5], clock)
    home = pool.tree.replicas(key)[0].instance
    while pool.tree.replicas(key):  # pushed out of its slab: held only in the tier
        pool.evict_one(home)
    (p,) = pool.tier.promote(pool.match([5, 5]).tier_keys)
    pool.tier.promoted(p)
    pool.record_access([((key,), {p.to: 1})] * 10)
    (rep,) = pool.rebalance()
    assert rep.key == key and rep.source.instance == p.to
    pool.finish_replication(rep)
    assert len(pool.tree.replicas(key)) == 2
    pool.check()


def test_a_segment_held_only_in_the_tier_whose_first_pages_a_prompt_shares_is_promoted():
    """A page hit into a segment held only in the tier: the segment is reported after
    the whole ones (or alone), and promoted whole where a slot is free (it evicts
    nothing for a part of a segment); then the match hits its pages."""
    cfg = PoolConfig(segment_tokens=4, namespace="tier", slots_per_instance=2, vnodes=8,
                     page_tokens=2, tier_slots=8)
    pool = CachePool(cfg, [0], lambda: 0.0, random.Random(0))

    def put(tokens):
        parent = None
        for i, key in enumerate(pool.hasher.keys(tokens)):
            pool.place(key, parent, i, tokens[i * 4:(i + 1) * 4])
            pool.commit(key, 0)
            parent = key
        pool.tier.settle()

    def promote(prompt):
        batch = tier_flow.begin(pool, [(prompt, None)])
        return 0 if batch is None else tier_flow.end(pool, batch, (set(), {}))

    doc = [1, 2, 3, 4, 5, 6, 7, 8]
    keys = pool.hasher.keys(doc)
    put(doc)
    put([9, 9, 9, 9, 10, 10, 10, 10])  # the document is held only in the tier
    prompt = [1, 2, 3, 4, 5, 6, 42, 43, 44]  # a whole segment, then one page of the second
    m = pool.match(prompt)
    assert m.keys == () and m.tier_keys == tuple(keys) and m.tier_partial
    assert promote(prompt) == 1  # the whole one; no slot is free for the other
    m = pool.match(prompt)  # the whole one in the slab: the page hit's segment alone
    assert m.keys == (keys[0],) and m.tier_keys == (keys[1],) and m.tier_partial and m.hit_tokens == 4
    pool.evict_one(0)  # a slot free now
    assert promote(prompt) == 1
    m = pool.match(prompt)
    assert m.keys == (keys[0],) and m.partial_key == keys[1] and m.hit_tokens == 6
    assert pool.match([1, 2, 3, 4, 42, 43, 44, 45]).tier_keys == ()  # no page shared: nothing
    pool.check()


def test_without_a_tier_evicted_segments_go():
    cfg = PoolConfig(segment_tokens=C, namespace="tier", slots_per_instance=2, vnodes=8)
    pool = CachePool(cfg, [0], lambda: 0.0)
    keys = store(pool, [1, 2, 3, 4])
    store(pool, [7, 7, 8, 8])
    assert keys[0] not in pool.tree and pool.match([1, 2, 3, 4]).tier_keys == ()
    assert pool.stats().tier is None


def test_the_tier_evicts_its_least_recently_used_copy():
    pool, clock = make_pool(slots=1, tier=2, instances=(0,))
    a = store(pool, [1, 1], clock)[0]
    b = store(pool, [2, 2], clock)[0]  # a is demoted
    c = store(pool, [3, 3], clock, settle=False)[0]  # b demoted; c's copy evicts a's (the oldest)
    ops = pool.tier.take_ops()
    assert ops[0].drops == [a]
    assert [w.key for w in ops[0].writes] == [c]
    pool.tier.staged([c])
    assert a not in pool.tree  # held only in the tier, its copy gone: it went
    assert pool.tree.node(b).tier_only and pool.tree.node(c).tier == 0
    assert pool.tier.stats().held == {0: 2}
    pool.check()


def test_a_parent_copy_that_a_tier_only_child_needs_is_kept():
    pool, clock = make_pool(slots=2, tier=4, instances=(0,))
    keys = store(pool, [1, 1, 2, 2], clock)  # a chain of two, both demoted next
    store(pool, [5, 5, 6, 6], clock)
    pool.tier.settle()
    assert all(pool.tree.node(k).tier_only for k in keys)
    # The tier is full: a new copy evicts the oldest copy that no child needs, the
    # chain's child (a leaf); the parent, older, stays for it.
    store(pool, [9, 9], clock)
    pool.tier.settle()
    assert keys[1] not in pool.tree and pool.tree.node(keys[0]).tier_only
    pool.check()


def test_a_failed_promotion_drops_the_segment_and_what_follows():
    pool, clock = make_pool(slots=2, instances=(0,))
    keys = store(pool, [1, 2, 3, 4], clock)
    store(pool, [7, 7, 8, 8], clock)
    pool.tier.settle()
    promos = pool.tier.promote(pool.match([1, 2, 3, 4]).tier_keys)
    used = pool.slots.used(0)
    pool.tier.promotion_failed(promos[0])
    pool.tier.promoted(promos[1])  # it went with its parent: nothing to do
    assert keys[0] not in pool.tree and keys[1] not in pool.tree
    assert pool.slots.used(0) == used - 2
    assert set(pool.tier.take_ops()[0].drops) == set(keys)
    pool.check()


def test_a_segment_held_only_in_the_tier_computed_again_gets_a_slot():
    pool, clock = make_pool(slots=2, instances=(0,))
    keys = store(pool, [1, 2, 3, 4], clock)
    store(pool, [7, 7, 8, 8], clock)
    pool.tier.settle()
    placed = pool.place(keys[0], None, 0, [1, 2])
    assert placed.created and pool.tree.node(keys[0]).tier == 0
    pool.abort(keys[0], placed.location.instance)  # a failed put: back in the tier only
    assert pool.tree.node(keys[0]).tier_only
    pool.check()


def test_an_instance_leaving_takes_its_tier_with_it():
    pool, clock = make_pool(slots=2, instances=(0, 1))
    for i in range(8):
        store(pool, [i, i, i + 1, i + 1], clock)
    pool.tier.settle()
    tiered = [k for k in pool.tree.keys() if pool.tree.node(k).tier == 1]
    assert tiered
    pool.remove_instance(1)
    assert all(pool.tree.node(k).tier != 1 for k in pool.tree.keys())
    pool.check()


def test_a_write_through_keeps_its_slot_until_staged():
    pool, clock = make_pool(slots=1, instances=(0,))
    store(pool, [1, 1], clock, settle=False)  # its write-through is queued, not staged
    with pytest.raises(CapacityError):
        store(pool, [2, 2], clock, settle=False)  # the only slot is leased by it
    pool.tier.settle()
    store(pool, [2, 2], clock)
    pool.check()


def test_a_new_control_plane_adopts_what_the_tier_holds():
    pool, clock = make_pool(slots=4, instances=(0,))
    doc = [1, 2, 3, 4, 5, 6]
    keys = store(pool, doc, clock, settle=False)
    writes = pool.tier.take_ops()[0].writes
    entries = [(w.key, w.parent, w.index, w.tokens) for w in writes]
    orphan = (b"\x07" * 16, b"\x09" * 16, 3, None)  # its parent is in no tree
    fresh, _ = make_pool(slots=4, instances=(0,))
    assert fresh.tier.adopt({0: [orphan, *reversed(entries)]}) == 3
    m = fresh.match(doc)
    assert m.keys == () and m.tier_keys == tuple(keys)
    assert fresh.tier.take_ops()[0].drops == [orphan[0]]  # its file goes
    fresh.check()
    small, _ = make_pool(slots=4, tier=2, instances=(0,))
    assert small.tier.adopt({0: entries}) == 2  # parents first, as many as fit
    assert small.match(doc).tier_keys == tuple(keys[:2])
    small.check()


def test_a_document_over_several_tiers_is_adopted_parent_first_across_them():
    """Its segments lie in both instances' tiers: each listing alone has children whose
    parent is in the other one, so the listings are adopted together."""
    pool, clock = make_pool(slots=8, tier=8)
    doc = list(range(1, 17))
    keys = store(pool, doc, clock, settle=False)
    listings = {i: [(w.key, w.parent, w.index, w.tokens) for w in op.writes]
                for i, op in pool.tier.take_ops().items()}
    assert len(listings) == 2 and all(listings.values()), "the test needs a document over both"
    fresh, _ = make_pool(slots=8, tier=8)
    for i in listings:  # the later instance first: no child may come before its parent
        listings[i] = listings[i][::-1]
    assert fresh.tier.adopt(dict(reversed(listings.items()))) == len(keys)
    assert fresh.match(doc).tier_keys == tuple(keys)
    fresh.check()


def test_tier_slots_is_checked():
    with pytest.raises(ConfigError):
        PoolConfig(segment_tokens=C, namespace="t", slots_per_instance=1, tier_slots=-1)


# ------------------------------------------------------------ the stateful test
DOCS = ([1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 4, 4], [5, 5, 6, 6], [7, 7], [1, 1, 8, 8, 9, 9])


class TierMachine(RuleBasedStateMachine):
    colocated = True  # the slabs are shared memory (promote_anywhere)

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.clock = make_pool(slots=3, tier=3, instances=(0, 1))
        self.pool.tier.promote_anywhere = self.colocated  # a read may land in the peer's slab
        self.slab: dict[tuple[int, int], bytes] = {}  # what each slot holds
        self.files: dict[tuple[int, bytes], bytes] = {}  # what each tier file holds
        self.late: list = []  # data-plane work taken, not yet answered
        self.stalled: list = []  # (reader, instance, slot, key): reads no one answered yet
        self.reading: list = []  # (batch, removals then): promotions begun, reads not over
        self.removals = 0  # of instance 1: its engines (and their reads) stopped

    def _run_ops(self, ops, refuse: int = 0) -> None:
        written, refused = [], []
        for inst, op in ops.items():
            for key in op.drops:
                self.files.pop((inst, key), None)
            for i, w in enumerate(op.writes):
                held = self.slab.get((inst, w.slot))
                assert held == w.key, "a write-through staged another segment's slot"
                if i < refuse:  # the staging memory was full
                    refused.append(w.key)
                    continue
                self.files[(inst, w.key)] = held
                written.append(w.key)
        self.pool.tier.staged(written, refused)

    @rule(ops=st.integers(0, 2))
    def data_plane_refusing(self, ops):
        self._run_ops(self.pool.tier.take_ops(), refuse=ops)

    @rule(doc=st.sampled_from(DOCS), dt=st.sampled_from([0.0, 1.0]))
    def store(self, doc, dt):
        self.clock[0] += dt
        parent = None
        for i, key in enumerate(self.pool.hasher.keys(doc)):
            try:
                placed = self.pool.place(key, parent, i, doc[i * C:(i + 1) * C])
            except CapacityError:
                return
            if placed.created:
                self.slab[(placed.location.instance, placed.location.slot)] = key
                self.pool.commit(key, placed.location.instance)
            parent = key

    @rule(now=st.booleans())
    def data_plane(self, now):
        ops = self.pool.tier.take_ops()
        if now:
            self._run_ops(ops)
        else:
            self.late.append(ops)

    @rule()
    def late_answers(self):
        while self.late:
            self._run_ops(self.late.pop(0))

    @rule(doc=st.sampled_from(DOCS), lose=st.booleans())
    def promote(self, doc, lose):
        m = self.pool.match(doc)
        for p in self.pool.tier.promote(m.tier_keys):
            src = self.files.get((p.instance, p.key))
            if lose and src is not None:
                del self.files[(p.instance, p.key)]
                src = None
            if src is None:
                self.pool.tier.promotion_failed(p)
            else:  # into the slot of the instance it was taken on (a co-located peer's, maybe)
                self.slab[(p.to, p.slot)] = src
                self.pool.tier.promoted(p)

    @rule(doc=st.sampled_from(DOCS))
    def promote_unanswered(self, doc):
        # the reads get no answer and the engine no fence: it may write them any time
        promos = self.pool.tier.promote(self.pool.match(doc).tier_keys)
        for p in promos:
            self.pool.tier.hold_back(p, 0)
            if (p.instance, p.key) in self.files:
                self.stalled.append((p.instance, p.to, p.slot, self.files[(p.instance, p.key)]))
        for p in promos:
            self.pool.tier.promotion_failed(p)

    @rule(doc=st.sampled_from(DOCS))
    def begin_promotion(self, doc):
        # the reads run outside the control plane's lock: anything may happen meanwhile
        batch = tier_flow.begin(self.pool, [(doc, None)])
        if batch is not None:
            self.reading.append((batch, self.removals))

    @rule(lose=st.booleans(), silent=st.booleans())
    def end_promotion(self, lose, silent):
        if not self.reading:
            return
        batch, removals = self.reading.pop(0)
        failed: set = set()
        unanswered: dict = {}  # key -> the epoch its read was sent at (fenced at 1 later)
        for p in batch.promos:
            src = self.files.get((p.instance, p.key))
            if p.instance == 1 and removals != self.removals:
                failed.add(p.key)  # its engine was stopped: nothing read
            elif silent:
                failed.add(p.key)
                unanswered[p.key] = 0
                if src is not None:
                    self.stalled.append((p.instance, p.to, p.slot, src))
            elif lose or src is None:
                failed.add(p.key)
            else:  # the engine writes the slot whatever the control plane thinks now
                self.slab[(p.to, p.slot)] = src
        tier_flow.end(self.pool, batch, (failed, unanswered))

    @rule()
    def stalled_reads_land_then_fence(self):
        for _reader, inst, slot, data in self.stalled:
            self.slab[(inst, slot)] = data  # late, into slots no one may have been given
        for reader in {s[0] for s in self.stalled}:
            self.pool.tier.release(reader, 1)  # a fence of a later epoch answered
        self.stalled = []

    @rule(inst=st.sampled_from([0, 1]))
    def evict(self, inst):
        self.pool.evict_one(inst)

    @rule()
    def remove_and_add(self):
        # Nothing is in flight across a removal (the driver's calls and the removal
        # take the control plane's lock): work sent to the failed engine is refused,
        # the rest answered.
        for ops in self.late:
            gone = ops.pop(1, None)
            if gone is not None:
                self.pool.tier.staged((), [w.key for w in gone.writes])
        self.late_answers()
        # a removed instance's engines are stopped: its own reads go with them; a
        # stalled read of instance 0 into its slab may still land after it joined again
        # on the same (zeroed) memory
        self.stalled = [s for s in self.stalled if s[0] != 1]
        self.removals += 1
        self.pool.remove_instance(1)
        self.slab = {k: v for k, v in self.slab.items() if k[0] != 1}
        self.files = {k: v for k, v in self.files.items() if k[0] != 1}
        self.pool.add_instance(1)

    @invariant()
    def consistent(self):
        self.pool.check()
        tree = self.pool.tree
        for key in tree.keys():
            for loc in tree.replicas(key):
                assert self.slab.get((loc.instance, loc.slot)) == key, "a ready slot holds another segment"
            node = tree.node(key)
            if node.locs and not (node.leases or node.pins or node.fast_kids):
                # nothing keeps it: it can make room (else a pool of such stops placing)
                assert all(r.lru_entry is not None for r in node.replicas if r.ready)


class OwnSlabsMachine(TierMachine):
    colocated = False  # each instance's reads into its own slab only (the default)


TierMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
OwnSlabsMachine.TestCase.settings = TierMachine.TestCase.settings
test_tier_machine = TierMachine.TestCase
test_tier_machine_own_slabs = OwnSlabsMachine.TestCase


def test_a_queued_write_through_goes_with_its_segment():
    """An instance fails while a write-through of a segment on another instance is
    queued, the segment going with its parent's subtree: the write must not run on
    the freed slot, which a new segment may hold by then (found by the machine above)."""
    m = TierMachine()
    m.store(DOCS[0], 0.0)
    m.store(DOCS[1], 0.0)
    m.remove_and_add()
    m.store(DOCS[0], 0.0)
    m.store(DOCS[2], 0.0)
    m.data_plane(True)
    m.consistent()


def test_a_request_computes_again_what_it_did_not_promote():
    """A plan over segments held only in the tier (not promoted: no slot could be had,
    or a client that does not promote) stores them again instead of waiting for them
    as if another iteration stored them; undone, they are back in the tier only."""
    from dataplane_util import TINY

    from tokenlake.core.control import ControlPlane
    from tokenlake.core.plans import Batch, BatchRequest

    cp = ControlPlane(PoolConfig(C, "t", 4, vnodes=8, page_tokens=C, tier_slots=8), TINY, [0],
                      clock=lambda: 0.0, rng=random.Random(0))
    doc = (1, 2, 3, 4, 5, 6)

    def run(rid, tokens, complete=True):
        plans = cp.gen_plans([Batch((BatchRequest(rid, tokens),), "prefill")], [1])
        if complete:
            cp.complete(plans)
            cp.finish_request(rid)
        else:
            cp.abort(plans)  # a new request's first plan: the request goes with it

    run("a", doc + (9,))
    run("b", (7, 7, 8, 8, 6, 6, 9))  # pushes the document out of the slab
    keys = cp.pool.hasher.keys(doc)
    assert all(cp.pool.tree.node(k).tier_only for k in keys)
    run("c", doc + (5,), complete=False)  # planned (stored again), then aborted
    assert all(cp.pool.tree.node(k).tier_only for k in keys)
    cp.check()
    run("d", doc + (5,))
    assert cp.pool.match(doc).keys == tuple(keys)
    cp.check()


def test_a_promotion_keeps_the_segment_it_hangs_under():
    """The last segment of a hit in the slab is a leaf there while what follows it is
    in the tier: the slots the promotions take must not come from it (else the
    promoted segments hang under a segment held only in the tier, and nothing hits)."""
    pool, clock = make_pool(slots=4, tier=8, instances=(0,))
    doc = [1, 1, 2, 2, 3, 3, 4, 4]
    keys = store(pool, doc, clock)
    store(pool, [7, 7, 8, 8], clock)  # newer: the document's last two go to the tier
    m = pool.match(doc)
    assert m.keys == tuple(keys[:2]) and m.tier_keys == tuple(keys[2:])
    for p in pool.tier.promote(m.tier_keys):
        pool.tier.promoted(p)
    pool.check()
    assert pool.match(doc).keys == tuple(keys)


def test_a_segment_without_a_copy_goes_with_its_children_held_in_the_tier():
    """Its copy was refused (or evicted from the tier): once its children are held
    only in the tier it is still evictable, and takes them along (else it would hold
    its slot for ever: a pool of such segments stops placing anything)."""
    pool, clock = make_pool(slots=2, tier=8, instances=(0,))
    k0, k1 = store(pool, [1, 1, 2, 2], clock, settle=False)
    pool.tier.take_ops()
    pool.tier.staged([k1], refused=[k0])  # k0 has no copy, k1 has
    store(pool, [5, 5], clock)  # k1 leaves the slab, held only in the tier
    assert pool.tree.node(k1).tier_only and pool.tree.node(k0).tier is None
    store(pool, [6, 6], clock, settle=False)  # k0 is the LRU victim now: it goes, k1 with it
    assert k0 not in pool.tree and k1 not in pool.tree
    ops = pool.tier.take_ops()[0]
    assert k1 in ops.drops
    pool.tier.staged(w.key for w in ops.writes)
    pool.check()


def test_a_promotion_takes_a_slot_elsewhere_where_slabs_are_shared():
    """The copy's instance has nothing to give (every slot leased): with co-located
    slabs the segment is read into a slot of another instance; without, it is not."""
    clock = [0.0]
    for shared in (True, False):
        cfg = PoolConfig(segment_tokens=C, namespace="tier", slots_per_instance=2, vnodes=8,
                         page_tokens=C, tier_slots=8, shared_memory=shared)
        pool = CachePool(cfg, [0, 1], lambda: clock[0], random.Random(0))
        keys = []
        for i in range(8):  # fill both slabs, demoting the oldest to the tiers
            keys += store(pool, [i, i], clock)
        tiered = next(k for k in keys if k in pool.tree and pool.tree.node(k).tier_only)
        home = pool.tree.node(tiered).tier
        pool.lease([k for k in pool.tree.keys() if pool.tree.replicas(k) and
                    pool.tree.replicas(k)[0].instance == home])
        promos = pool.tier.promote([tiered])
        if shared:
            assert [(p.instance, p.to) for p in promos] == [(home, 1 - home)]
            pool.tier.promoted(promos[0])
            assert pool.tree.replicas(tiered)[0].instance == 1 - home
        else:
            assert promos == []
        pool.check()


def test_adoption_takes_only_this_pools_segments_once():
    """A file's key must be the hash of its parent and tokens in this pool's namespace
    (a tier directory written by another model or layout is not read as this one's); a
    segment listed twice is adopted once, its file kept."""
    pool, clock = make_pool(slots=4, instances=(0,))
    store(pool, [1, 2, 3, 4], clock, settle=False)
    entries = [(w.key, w.parent, w.index, w.tokens) for w in pool.tier.take_ops()[0].writes]
    cfg = PoolConfig(segment_tokens=C, namespace="another model", slots_per_instance=4, vnodes=8,
                     page_tokens=C, tier_slots=8)
    other = CachePool(cfg, [0], lambda: 0.0, random.Random(0))
    assert other.tier.adopt({0: entries}) == 0
    assert sorted(other.tier.take_ops()[0].drops) == sorted(e[0] for e in entries)
    fresh, _ = make_pool(slots=4, instances=(0,))
    assert fresh.tier.adopt({0: entries + entries}) == len(entries)
    assert fresh.tier.take_ops() == {}  # nothing dropped
    forged = (entries[0][0], None, 0, (9).to_bytes(4, "little") * C)  # another segment's tokens
    assert make_pool(slots=4, instances=(0,))[0].tier.adopt({0: [forged]}) == 0
    fresh.check()


def test_a_promotion_that_fails_before_reading_leaves_the_tier_as_it_was():
    """The data plane raises (or a later prompt is refused) after slots were taken: the
    pending replicas go, the segments are held only in the tier again, nothing leaks."""
    from dataplane_util import TINY

    from tokenlake.core.control import ControlPlane

    cp = ControlPlane(PoolConfig(C, "t", 2, vnodes=8, page_tokens=C, tier_slots=8), TINY, [0],
                      clock=lambda: 0.0, rng=random.Random(0))
    keys = store(cp.pool, [1, 2, 3, 4])
    store(cp.pool, [5, 6, 7, 8])

    class Broken:
        def tier_read(self, promotions):
            raise RuntimeError("the engine went away")

    cp.tier_data_plane = Broken()
    used = cp.pool.slots.used(0)
    with pytest.raises(RuntimeError):
        cp.promote([([1, 2, 3, 4, 9], None)])
    assert all(cp.pool.tree.node(k).tier_only for k in keys)
    assert cp.pool.slots.used(0) <= used and cp.pool.stats().tier.failed_promotions == 0
    cp.check()


def test_slots_an_unanswered_read_names_stay_taken_until_its_engine_is_fenced_or_gone():
    """The data plane got no answer to a read and could not fence its engine: the
    promotions fail, their slots stay taken (named by no replica) until the data plane
    reports the engine fenced, or the instance leaves the pool."""
    from dataplane_util import TINY

    from tokenlake.core.control import ControlPlane

    cp = ControlPlane(PoolConfig(C, "t", 4, vnodes=8, page_tokens=C, tier_slots=8), TINY, [0, 1],
                      clock=lambda: 0.0, rng=random.Random(0))

    class Silent:  # reads sent at epoch 3, never answered; fences answered on demand
        ready: dict[int, int] = {}

        def tier_ops(self, ops):
            return [w.key for op in ops.values() for w in op.writes], []

        def tier_read(self, promotions):
            keys = {p.key for p in promotions}
            return keys, dict.fromkeys(keys, 3)

        def fenced(self):
            return dict(self.ready)

        def counters(self):
            return {}

    plane = cp.tier_data_plane = Silent()
    doc = [1, 1, 2, 2, 3, 3, 4, 4]
    store(cp.pool, doc)
    store(cp.pool, [5, 5, 6, 6, 7, 7, 8, 8])
    store(cp.pool, [9, 9, 10, 10, 11, 11])  # the document's end is pushed out of both slabs
    assert len(cp.pool.match(doc).tier_keys) == 2
    assert cp.promote([(doc + [9], None)]) == 0
    held = cp.pool.tier.held_back()
    assert held and cp.pool.stats().tier.failed_promotions > 0
    named = {(loc.instance, loc.slot) for k in cp.pool.tree.keys()
             for loc in cp.pool.tree.replicas(k, ready_only=False)}
    assert not named & set(held)
    cp.check()  # the slot accounting counts them taken
    readers = sorted({p for p in cp.pool.tier._held_back})
    plane.ready = {r: 3 for r in readers}  # answered at the reads' own epoch: they may still land
    cp.flush_tier()
    assert sorted(cp.pool.tier.held_back()) == sorted(held)
    plane.ready = {readers[0]: 4}  # a later epoch: the first reader's reads are over
    cp.flush_tier()
    left = cp.pool.tier.held_back()
    assert left == [(i, s) for r in readers[1:] for i, s, _ in cp.pool.tier._held_back[r]]
    cp.check()
    for r in readers[1:]:
        cp.remove_instance(r)  # its engines are stopped: what they held goes too
    assert cp.pool.tier.held_back() == []
    cp.check()


def test_a_stalled_readers_slot_in_a_peer_that_joins_again_stays_taken_until_it_is_fenced():
    """Co-located slabs: instance 0's transfer engine read into a slot of instance 1's
    slab and did not answer. Instance 1 leaves and joins again on the same (zeroed)
    memory: that slot is taken again, held back, until instance 0 is fenced; fenced
    before the return, nothing is taken."""
    from dataplane_util import TINY

    from tokenlake.core.control import ControlPlane

    cp = ControlPlane(PoolConfig(C, "t", 4, vnodes=8, page_tokens=C, tier_slots=8), TINY, [0, 1],
                      clock=lambda: 0.0, rng=random.Random(0))

    class Plane:
        ready: dict[int, int] = {}

        def tier_ops(self, ops):
            return [w.key for op in ops.values() for w in op.writes], []

        def tier_read(self, promotions):
            return set(), {}

        def fenced(self):
            return dict(self.ready)

        def counters(self):
            return {}

    plane = cp.tier_data_plane = Plane()
    tier, slots = cp.pool.tier, cp.pool.slots
    for fence_first in (False, True):
        slot = slots.allocate(1)
        tier._held_back[0] = [(1, slot, 3)]  # as hold_back records a silent read of 0 into 1's slab
        cp.check()
        cp.remove_instance(1)
        assert tier.held_back() == []
        if fence_first:
            plane.ready = {0: 4}
            cp.flush_tier()
        cp.add_instance(1)
        cp.check()
        if fence_first:  # its late writes are refused now: nothing to guard
            assert tier.held_back() == [] and slots.free_count(1) == slots.capacity(1)
            continue
        assert tier.held_back() == [(1, slot)] and slots.free_count(1) == slots.capacity(1) - 1
        for i in range(3):  # the other slots fill; the held one is given to nobody
            store(cp.pool, [20 + i] * (2 * C))
        assert all(loc != (1, slot) for k in cp.pool.tree.keys()
                   for loc in [(r.instance, r.slot) for r in cp.pool.tree.replicas(k, ready_only=False)])
        cp.check()
        plane.ready = {0: 4}  # fenced at a later epoch: the read can no longer land
        cp.flush_tier()
        assert tier.held_back() == []
        cp.check()
        plane.ready = {}


def test_a_read_into_a_peer_that_leaves_and_joins_again_keeps_its_slot_until_it_ends():
    """Co-located slabs, a read of instance 0 into instance 1's slab still running when
    instance 1 leaves and joins again on the same memory: the slot is kept for the read
    (given to no new segment) until it ends; unanswered, until the reader is fenced.
    (The steps that lead there are drawn once, from a fixed seed.)"""
    rng = random.Random(8616)
    m = TierMachine()
    for _ in range(20):
        r = rng.random()
        if r < .4:
            m.store(rng.choice(DOCS), rng.choice([0.0, 1.0]))
        elif r < .6:
            m.data_plane(True)
        elif r < .75:
            m.evict(rng.choice([0, 1]))
        else:
            m.begin_promotion(rng.choice(DOCS))
    cross = [i for i, (b, _) in enumerate(m.reading) if any(p.instance == 0 and p.to == 1 for p in b.promos)]
    assert cross, "the seed no longer leads to a read into the peer's slab"
    keep = m.reading.pop(cross[0])
    while m.reading:  # the others end, answered
        m.end_promotion(False, False)
    m.reading = [keep]
    m.remove_and_add()  # the read into its slab still running
    for doc in DOCS:  # new segments fill the slab that joined again
        m.store(doc, 1.0)
    m.consistent()
    m.end_promotion(False, True)  # unanswered: its engine may still write the slot
    m.consistent()
    assert m.pool.tier.held_back()
    m.stalled_reads_land_then_fence()  # it lands, then a fence
    m.consistent()
    assert m.pool.tier.held_back() == []


def test_a_promotion_that_ends_after_its_leased_segment_went_and_came_back_releases_nothing_of_it():
    """A promotion leased the prompt's hit; the hit's instance left during the read and
    the segment was stored again (its new node leased for its write-through): the end of
    the promotion releases only the nodes it leased, not the new one's lease. (A step
    sequence the tier machine once found, replayed.)"""
    m = TierMachine()
    steps = [("late",), ("store", [1, 1, 8, 8, 9, 9], 1.0), ("evict", 1), ("data_plane", True), ("evict", 1),
             ("land",), ("late",), ("store", [1, 1, 2, 2, 4, 4], 0.0), ("evict", 1),
             ("begin", [1, 1, 8, 8, 9, 9]), ("data_plane", True), ("store", [7, 7], 1.0),
             ("begin", [1, 1, 2, 2, 3, 3]), ("late",), ("store", [5, 5, 6, 6], 1.0),
             ("begin", [1, 1, 2, 2, 3, 3]), ("data_plane", True), ("store", [5, 5, 6, 6], 0.0),
             ("store", [1, 1, 2, 2, 3, 3], 0.0), ("late",), ("remove_and_add",),
             ("store", [1, 1, 2, 2, 4, 4], 0.0), ("end", False, False)]
    run = {"late": m.late_answers, "store": m.store, "evict": m.evict, "data_plane": m.data_plane,
           "land": m.stalled_reads_land_then_fence, "begin": m.begin_promotion,
           "remove_and_add": m.remove_and_add, "end": m.end_promotion}
    for name, *args in steps:
        run[name](*args)
        m.consistent()

"""Slot records (docs/design.md §4 "Restart"): the records a control plane writes beside
its slots rebuild, in a new control plane, the same tree, replicas and LRU order; a
pending replica, a torn record or one whose key is not its tokens' hash is never adopted."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.dataplane_util import TINY, ManualClock
from tokenlake.core.control import pool_control
from tokenlake.core.restore import restore
from tokenlake.core.segments import SegmentHasher
from tokenlake.deploy.records import RecordTables, record_bytes

C = 8
INSTANCES = 3


def _pool(clock, slots_per_instance: int = 6):
    seg_bytes = TINY.num_layers * 2 * TINY.num_kv_heads * C * TINY.head_dim * 4
    control = pool_control(INSTANCES, TINY, slots_per_instance * seg_bytes, C, "float32", clock,
                           page_tokens=4)
    return control.pool


def _journal(pool, tables, clock):
    journal = RecordTables(C, pool.hasher.root, clock, wall=lambda: clock.now + 1.7e9)
    for inst, arr in tables.items():
        journal.attach(inst, arr)
    pool.tree.journal = journal
    return journal


def _store(pool, clock, tokens, salt=None, commit=True):
    """Places and commits every whole segment of ``tokens`` (like a completed put)."""
    parent = pool.tree.root_key(salt)
    keys = pool.hasher.keys(tokens, parent)
    for i, key in enumerate(keys):
        clock.now += 1.0
        placed = pool.place(key, parent, i, tokens[i * C:(i + 1) * C])
        if placed.created and commit:
            pool.commit(key, placed.location.instance)
        parent = key
    return keys


def _state(pool):
    """What a restart must give back: ready replicas with their node's parent, index and
    tokens, and each replica's LRU time."""
    tree = pool.tree
    return {(k, loc.instance, loc.slot): (tree.parent(k), tree.index(k), tree.tokens(k),
                                          round(tree.last_access(k, loc.instance), 6))
            for k in tree.keys() for loc in tree.replicas(k)}


def _victims(pool):
    out = []
    while (v := pool.evict_one()) is not None:
        out.append((v.key, v.instance))
    return out


def _restored(tables, clock):
    fresh = _pool(clock)
    journal = _journal(fresh, tables, clock)
    records = []
    for inst in range(INSTANCES):
        recs, torn = journal.read(inst)
        records += recs
    report = restore(fresh, records, on_refused=lambda rec, why: journal.cleared(rec.instance, rec.slot))
    fresh.check()
    return fresh, report


@pytest.fixture
def tables():
    return {i: np.zeros((6, record_bytes(C)), dtype=np.uint8) for i in range(INSTANCES)}


def test_records_rebuild_the_same_tree_replicas_and_lru_order(tables):
    clock = ManualClock(1000.0)
    pool = _pool(clock)
    _journal(pool, tables, clock)
    rng = random.Random(7)
    docs = [[rng.randrange(1000) for _ in range(4 * C)] for _ in range(3)]
    for doc in docs:
        _store(pool, clock, doc)
    _store(pool, clock, docs[0][:2 * C] + [5] * 2 * C)  # a branch under a shared prefix
    _store(pool, clock, docs[1], salt="tenant-a")  # the same tokens under a salt
    clock.now += 1
    pool.release_chain((), [(k, pool.tree.replicas(k)[0].instance) for k in pool.hasher.keys(docs[2])[:2]])
    pending = _store(pool, clock, [9] * 2 * C, commit=False)  # stored, never completed
    before = _state(pool)
    assert before and not any(k in pending for k, _, _ in before)

    fresh, report = _restored(tables, clock)
    assert _state(fresh) == before
    assert report.segments == len(before) and not report.refused
    assert all(k not in fresh.tree for k in pending), "a pending segment is adopted"
    for q in (docs[0][:3 * C + 6], docs[1], docs[2][:C + 5]):
        assert fresh.match(q) == pool.match(q) and pool.match(q).hit_tokens >= C
    assert fresh.match(docs[1], salt="tenant-a").keys == pool.match(docs[1], salt="tenant-a").keys
    assert _victims(fresh) == _victims(pool), "LRU order differs"


def test_evicted_and_removed_replicas_leave_no_record(tables):
    clock = ManualClock(1000.0)
    pool = _pool(clock)
    _journal(pool, tables, clock)
    rng = random.Random(3)
    for _ in range(12):  # 4 segments each into 18 slots: evictions
        _store(pool, clock, [rng.randrange(1000) for _ in range(4 * C)])
    assert pool.stats().evictions > 0
    pool.remove_instance(1)
    before = _state(pool)
    fresh, report = _restored(tables, clock)
    assert not report.refused or all(i == 1 for i, _, _ in report.refused)
    assert {k: v for k, v in _state(fresh).items() if k[1] != 1} == before


def test_a_torn_or_forged_record_is_refused_with_what_hangs_under_it(tables):
    clock = ManualClock(1000.0)
    pool = _pool(clock)
    journal = _journal(pool, tables, clock)
    doc = list(range(100, 100 + 3 * C))
    keys = _store(pool, clock, doc)
    where = {k: pool.tree.replicas(k)[0] for k in keys}
    first = where[keys[0]]
    tables[first.instance].view(journal.dtype)[first.slot]["tokens"][0] += 1  # torn: digest fails
    fresh, report = _restored(tables, clock)
    assert len(fresh.tree) == 0, "a suffix without its first segment was adopted"
    assert {(i, s) for i, s, _ in report.refused} == {(w.instance, w.slot) for w in where.values()} - {
        (first.instance, first.slot)}
    # a record whose digest holds but whose key is not its tokens' hash
    pool2 = _pool(clock)
    tables2 = {i: np.zeros_like(t) for i, t in tables.items()}
    j2 = _journal(pool2, tables2, clock)
    keys = _store(pool2, clock, doc)
    loc = pool2.tree.replicas(keys[0])[0]
    j2.sealed(loc.instance, loc.slot, keys[0], None, 0, bytes(4 * C), clock())  # other tokens
    fresh, report = _restored(tables2, clock)
    assert len(fresh.tree) == 0 and any("hash" in why for *_, why in report.refused)


def test_records_of_another_namespace_are_not_read(tables):
    clock = ManualClock(1000.0)
    pool = _pool(clock)
    _journal(pool, tables, clock)
    _store(pool, clock, list(range(2 * C)))
    other = RecordTables(C, SegmentHasher(C, "another-model/f32/C8").root, clock)
    for inst, arr in tables.items():
        other.attach(inst, arr)
    sealed = {i: _sealed_slots(arr) for i, arr in tables.items()}
    assert sum(map(len, sealed.values())) == 2
    assert all(other.read(i) == ([], sealed[i]) for i in tables)
    assert not any(_sealed_slots(arr) for arr in tables.values()), "a foreign record stays"


def _sealed_slots(arr):
    from tokenlake.deploy.records import SEALED

    return [int(s) for s in np.flatnonzero(arr[:, :4].copy().view("<u4")[:, 0] == SEALED)]

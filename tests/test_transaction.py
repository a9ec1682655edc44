"""Tests of the planning transaction (tokenlake/core/transaction.py).

A failed ``gen_plans`` must leave the pool exactly as it was, the replicas it evicted
included; the transaction lists those evictions as typed records, oldest first. An
abort after the data plane saw the plans undoes the plans but not the evictions.
"""

from __future__ import annotations

import random

import pytest
from pool_state import pool_state

from tokenlake.core.config import PoolConfig
from tokenlake.core.control import ControlPlane
from tokenlake.core.errors import CapacityError
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.pool import CachePool, Eviction
from tokenlake.core.request_table import RequestTable
from tokenlake.core.specs import load_model
from tokenlake.core.store_plan import StorePlanner
from tokenlake.core.transaction import Transaction

C = 2
X = [1, 2, 3, 4, 5, 6, 7, 8]  # four segments, stored first


def fill(pool: CachePool, clock: list[float]) -> list[bytes]:
    """Stores X (one segment per clock second, so its LRU times are 1, 2, 3, 4)."""
    keys = pool.hasher.keys(X)
    for i, key in enumerate(keys):
        clock[0] = float(i + 1)
        placed = pool.place(key, keys[i - 1] if i else None, i)
        pool.commit(key, placed.location.instance)
    clock[0] = 10.0
    return keys


def request_table(table: RequestTable) -> dict:
    return {s.request_id: (list(s.chain), s.tail, list(s.tail_tokens), s.busy)
            for s in table.states()}


def test_a_failure_midway_restores_the_pool_exactly_and_lists_the_evictions():
    clock = [0.0]
    pool = CachePool(PoolConfig(C, "tx", slots_per_instance=4), [0], lambda: clock[0],
                     random.Random(0))
    table = RequestTable(C)
    planner = StorePlanner(pool, table)
    x = fill(pool, clock)
    slots = {k: pool.tree.replicas(k)[0].slot for k in x}
    before = pool_state(pool)
    # "a" stores 2 segments and "b" 3: the pool evicts X leaf by leaf (4 replicas), then
    # has nothing evictable left for b's third segment (the new ones are pending).
    batches = [Batch((BatchRequest("a", (50, 51, 52, 53)), BatchRequest("b", (60,) * 6)))]
    tx = Transaction(0)
    with pytest.raises(CapacityError):
        planner.prepare(batches, tx)
    assert len(pool.tree) == 4 and not any(k in pool.tree for k in x)
    assert tx.evictions == [
        Eviction(x[3], x[2], 3, 0, slots[x[3]], 4.0),
        Eviction(x[2], x[1], 2, 0, slots[x[2]], 3.0),
        Eviction(x[1], x[0], 1, 0, slots[x[1]], 2.0),
        Eviction(x[0], None, 0, 0, slots[x[0]], 1.0),
    ]
    tx.rollback(pool, table)
    assert pool_state(pool) == before
    assert table.ids() == ()
    pool.check()
    table.check(pool)


def make_cp(slots: int, clock: list[float]) -> ControlPlane:
    config = PoolConfig(C, "tx", slots_per_instance=slots)
    return ControlPlane(config, load_model("smollm2-135m"), [0, 1], clock=lambda: clock[0])


def run(cp: ControlPlane, *reqs: BatchRequest):
    plans = cp.gen_plans([Batch(reqs)], [1])
    cp.complete(plans)
    return plans


def test_failed_gen_plans_after_sealing_and_opening_tails_restores_everything():
    """The failing iteration seals one open tail, dedups another into a cached segment,
    opens new tails and evicts before the pool runs out: all of it is undone."""
    clock = [0.0]
    cp = make_cp(slots=4, clock=clock)
    run(cp, BatchRequest("c", (1, 2, 9, 4)))  # segments (1, 2) and (9, 4), leased by c
    run(cp, BatchRequest("s", (1, 2, 3)))  # dedups (1, 2); an open tail (3)
    run(cp, BatchRequest("d", (1, 2, 9)))  # dedups (1, 2); an open tail (9)
    clock[0] = 1.0
    run(cp, BatchRequest("old", (7, 7)))
    cp.finish_request("old")  # an evictable leaf
    clock[0] = 2.0
    before = (pool_state(cp.pool), request_table(cp.requests), cp.stats())
    with pytest.raises(CapacityError):
        cp.gen_plans([Batch((
            BatchRequest("s", (4, 5)),  # seals (3, 4) in place, opens a tail (5)
            BatchRequest("d", (4, 6, 6)),  # (9, 4) is cached: dedup; (6, 6) takes a slot
            BatchRequest("n", (8, 8, 8, 8, 8)),  # a slot, old's slot (evicted), then none
        ))], [1])
    assert (pool_state(cp.pool), request_table(cp.requests), cp.stats()) == before
    cp.check()
    # The same requests go on as if the failed call never happened.
    run(cp, BatchRequest("s", (4,)))
    assert cp.prefix_tokens("s") == 4 and cp.get_prefix_tree().match([1, 2, 3, 4]).hit_tokens == 4
    cp.check()


def test_abort_undoes_the_plans_but_not_their_evictions():
    clock = [0.0]
    cp = make_cp(slots=2, clock=clock)
    run(cp, BatchRequest("x", (1, 2, 3, 4, 5, 6, 7, 8)))
    cp.finish_request("x")
    tree = cp.get_prefix_tree()
    assert len(tree) == 4 and cp.stats().pool.evictions == 0
    plans = cp.gen_plans([Batch((BatchRequest("a", (50, 51, 52, 53)),))], [1])
    assert cp.stats().pool.evictions == 2  # two leaves of x made room
    cp.abort(plans)  # the data plane may have written the freed slots: they stay freed
    assert len(tree) == 2 and cp.stats().pool.evictions == 2
    assert cp.get_prefix_tree().match([1, 2, 3, 4, 5, 6, 7, 8]).hit_tokens == 4
    assert sum(cp.stats().pool.slots_used.values()) == 2 and cp.live_requests == ()
    cp.check()

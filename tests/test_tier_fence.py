"""Fencing a transfer engine that stalls while its tier is read (``TierDriver``): the
driver gets no answer, raises the instance's epoch and fences the engine; until the
engine has answered the fence, the slots the unanswered read names stay taken, so a
read carried out late can never overwrite a segment placed there since. Real engine
processes (a stall is ``SIGSTOP``); answers checked against float64 attention."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from dataplane_util import TINY, check_iteration

from tokenlake.dataplane.messages import TierDone, TierOps, TierRead
from tokenlake.deploy import tier as tier_driver
from tokenlake.deploy.local import LocalCluster

C = 8
SLOT = TINY.num_layers * 2 * TINY.num_kv_heads * C * TINY.head_dim * 4
SLOTS = 12


def _doc(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 900) for _ in range(n)]


@pytest.fixture
def pool():
    with LocalCluster(1, TINY, SLOTS * SLOT, segment_tokens=C, max_rows=64, timeout_s=1.0,
                      tier_bytes=64 * SLOT) as cluster:
        yield cluster


def _push_out(cluster, doc) -> tuple:
    """Stores ``doc``, then enough others to push it out of the slab; returns its
    segments held only in the tier."""
    cp = cluster.control
    check_iteration(cluster, {"d": doc}, {"d": len(doc)}, {"d": 0})
    cp.finish_request("d")
    for i in range(SLOTS // 4 + 1):
        other = {f"o{i}": _doc(100 + i, 4 * C)}
        check_iteration(cluster, other, {f"o{i}": 4 * C}, {f"o{i}": 0})
        cp.finish_request(f"o{i}")
    m = cp.get_prefix_tree().match(doc, max_tokens=len(doc) - 1)
    assert m.tier_keys and not m.keys
    return m.tier_keys


def test_an_engine_refuses_tier_messages_older_than_its_fence(pool):
    doc = _doc(1, 3 * C + 2)
    keys = _push_out(pool, doc)
    slab = pool.slab(0)
    cp = pool.control.pool
    cp.evict_one(0)
    free = cp.slots.allocate(0)  # taken here: nothing else is placed in it
    before = slab[free].clone()
    epoch = pool.control.tier_data_plane._epoch_of(0)  # what the driver sends now
    fence = pool._request(("transfer", 0), TierOps(epoch=epoch + 3), TierDone)
    assert not fence.done and not fence.failed and fence.counters["answers"] >= 1
    late = pool._request(("transfer", 0), TierRead(((keys[0], free, -1),), epoch + 2), TierDone)
    assert late.failed == (keys[0],) and not late.done
    assert bool((slab[free] == before).all()), "a fenced-off read wrote its slot"
    now = pool._request(("transfer", 0), TierRead(((keys[0], free, -1),), epoch + 3), TierDone)
    assert now.done == (keys[0],) and not bool((slab[free] == before).all())


def test_a_new_driver_adopting_a_fenced_engine_is_not_refused(pool):
    """An engine fenced by one driver (its epoch raised) is adopted by the driver of a
    new control process: that one's epochs start above, so its requests are served."""
    from tokenlake.deploy.tier import TierDriver

    epoch = pool.control.tier_data_plane._epoch_of(0)
    pool._request(("transfer", 0), TierOps(epoch=epoch + 5), TierDone)  # fenced a few times
    new = pool.control.tier_data_plane = TierDriver(pool)
    assert new._epoch_of(0) > epoch + 5
    other = _doc(5, 3 * C + 2)
    _push_out(pool, other)  # written through, pushed out: its copies were not refused
    tokens = {"q": other + _doc(6, 5)}
    assert pool.control.promote([(tokens["q"], None)]) == 3, "the new driver's reads were refused"
    assert check_iteration(pool, tokens, {"q": 5}, {"q": 3 * C}) == {"q": 3 * C}


def test_a_stalled_engine_keeps_its_read_slots_taken_until_it_answers_a_fence(pool, monkeypatch):
    """...and the driver's own thread fences it: the control plane's calls meanwhile
    send nothing to it (a stalled engine costs them no timeout)."""
    monkeypatch.setattr(tier_driver, "FENCE_RETRY_S", 0.0)
    cp, driver = pool.control, pool.control.tier_data_plane
    doc = _doc(2, 3 * C + 2)
    _push_out(pool, doc)
    pid = pool._procs[("transfer", 0)].pid
    sent = []
    request = pool._request
    monkeypatch.setattr(pool, "_request", lambda key, *a: sent.append(key) or request(key, *a))
    os.kill(pid, signal.SIGSTOP)
    try:
        assert cp.promote([(doc, None)]) == 0  # no answer, no fence: nothing trusted
        held = cp.pool.tier.held_back()
        assert held, "the unanswered read's slots were freed"
        cp.check()  # they count as taken
        taken = {(loc.instance, loc.slot) for k in cp.pool.tree.keys()
                 for loc in cp.pool.tree.replicas(k, ready_only=False)}
        assert not taken & set(held)
        for _ in range(3):
            cp.flush_tier()
        assert ("transfer", 0) not in sent, "a control-plane call waited for the stalled engine"
        assert driver._epoch_of(0) is None
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while driver._epoch_of(0) is None:  # the driver's thread fences it, nobody calls
        assert time.monotonic() < deadline, "the stalled engine was never fenced"
        time.sleep(0.02)
    cp.flush_tier()  # the engine answered the fence: they are free
    assert cp.pool.tier.held_back() == []
    cp.check()
    tokens = {"q": doc + _doc(3, 5)}
    hits = check_iteration(pool, tokens, {"q": len(tokens["q"])}, {"q": 0})  # exact: nothing stale
    assert hits == {"q": 0}


def test_the_driver_keeps_each_engines_newest_counters():
    """An engine's answers reach the driver by three sockets (writes, reads, fences), so
    an older one may come last: the counters it carries are kept only if newer (more
    ``answers``), and a removed instance's are forgotten."""

    class Control:
        instances = [1]

    class Cluster:
        control = Control()

    driver = tier_driver.TierDriver(Cluster(), background=False)
    driver._answered(0, 1, TierDone(counters={"answers": 5.0, "reads": 3.0}))
    driver._answered(0, 1, TierDone(counters={"answers": 4.0, "reads": 2.0}))  # late, older
    driver._answered(1, 1, TierDone(counters={"answers": 1.0, "write_errors": 1.0}))
    assert driver.counters() == {0: {"answers": 5.0, "reads": 3.0}, 1: {"answers": 1.0, "write_errors": 1.0}}
    driver._answered(0, 2, TierDone(counters={"answers": 6.0, "reads": 4.0}))
    assert driver.counters()[0]["reads"] == 4.0
    driver._forget_gone()  # instance 0 left the pool
    assert list(driver.counters()) == [1]

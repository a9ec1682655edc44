"""Cache-first admission order (scheduler/admission.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_sim import SMALL, make_trace

from evals.sim.systems import simulate
from scheduler.admission import admission_order, waits_for_flight

# (name, cached tokens, overdue), in arrival order
QUEUE = [("a", 0, False), ("b", 300, False), ("c", 0, True), ("d", 500, False),
         ("e", 300, False), ("f", 10, True)]


def _order(rule: str) -> list[str]:
    got = admission_order(QUEUE, cached=lambda r: r[1], overdue=lambda r: r[2], rule=rule)
    return [r[0] for r in got]


def test_overdue_first_oldest_first_then_longest_cached_prefix():
    # c and f waited past their patience: first, in arrival order whatever they hit;
    # then d (500 cached), b and e (300, arrival order), a (nothing cached).
    assert _order("cache-first") == ["c", "f", "d", "b", "e", "a"]


def test_fcfs_keeps_arrival_order():
    assert _order("fcfs") == ["a", "b", "c", "d", "e", "f"]


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="admission must be one of"):
        _order("lpm")


def test_a_request_waits_for_its_next_segment_only_while_patient():
    pending, claimed = {b"k1": object()}, {b"k2"}
    assert waits_for_flight(b"k1", (pending, claimed), overdue=False)
    assert waits_for_flight(b"k2", (pending, claimed), overdue=False)
    assert not waits_for_flight(b"k3", (pending, claimed), overdue=False)
    assert not waits_for_flight(None, (pending, claimed), overdue=False)  # all of it ready
    assert not waits_for_flight(b"k1", (pending, claimed), overdue=True)
    assert not waits_for_flight(b"k1", (pending, claimed), overdue=False, rule="fcfs")


@pytest.mark.parametrize("seed", [0, 1])
def test_cache_first_hits_more_than_fcfs_on_a_full_pool(seed):
    """Sixteen long documents asked about in bursts on a pool that holds a few of
    them: offering admission to the requests whose document is cached first (and
    holding those whose document is being computed) hits more, and the time to first
    token falls with the work saved."""
    reqs = make_trace(60, seed=seed, gap_s=0.02, docs=16, doc_blocks=(8, 14))
    first = simulate(reqs, "tokenlake", SMALL)
    fcfs = simulate(reqs, "tokenlake", replace(SMALL, admission="fcfs"))
    assert first.hit_rate > fcfs.hit_rate
    assert first.mean_ttft_s < fcfs.mean_ttft_s

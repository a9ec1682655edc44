"""``ControlPlane.lease_prefix``: a request admitted with its cached prefix leased, outside
any iteration (what a framework that copies KV out of the pool, the vLLM connector,
needs): the replicas it returns stay put until the request finishes, later iterations
add its new tokens, and a refused lease changes nothing."""

from __future__ import annotations

import pytest
from test_control import batch, keys_of, make_cp, req, run, tree_state

from tokenlake.core.errors import PlanError, PrefixNotCached


def test_the_leased_replicas_stay_until_the_request_finishes():
    cp = make_cp(c=4, slots=4, instances=(0, 1))  # 8 slots in all
    doc = list(range(100, 116))  # 4 segments
    run(cp, [batch(req("a", doc))])
    cp.finish_request("a")
    locs = cp.lease_prefix("b", doc[:12])  # 3 segments leased
    tree = cp.get_prefix_tree()
    keys = keys_of(cp, doc[:12])
    assert [loc in tree.replicas(k) for k, loc in zip(keys, locs)] == [True] * 3
    assert "b" in cp.live_requests and cp.stats().hit_tokens == 12
    # other requests fill the pool: the unleased 4th segment may go, the leased ones stay
    for i in range(3):
        run(cp, [batch(req(f"x{i}", range(1000 * (i + 1), 1000 * (i + 1) + 8)))])
        cp.finish_request(f"x{i}")
    assert all(loc in tree.replicas(k) for k, loc in zip(keys, locs))
    # its new tokens come in a later iteration, without a prefix; its prefix is read there
    plans = run(cp, [batch(req("b", [7, 7, 7, 7, 8]))])
    (qp,) = plans.query_plans
    read = sorted((t.instance, s) for t in qp.tasks for it in t.items for s in it.slots)
    assert read == sorted((loc.instance, loc.slot) for loc in locs)
    cp.finish_request("b")
    cp.check()


@pytest.mark.parametrize("prefix,error", [
    (list(range(100, 106)), PrefixNotCached),  # not whole segments
    (list(range(200, 208)), PrefixNotCached),  # not cached
    ([], PrefixNotCached),
])
def test_a_refused_lease_changes_nothing(prefix, error):
    cp = make_cp(c=4)
    run(cp, [batch(req("a", list(range(100, 116))))])
    before = (tree_state(cp), cp.live_requests, cp.stats())
    with pytest.raises(error):
        cp.lease_prefix("b", prefix)
    assert (tree_state(cp), cp.live_requests, cp.stats()) == before
    with pytest.raises(PlanError, match="live already"):
        cp.lease_prefix("a", list(range(100, 104)))
    cp.check()

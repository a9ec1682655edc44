"""Baseline policies (docs/design.md §6): scripted decisions checked against sgl-router's rules."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.baselines.cache_aware_router import CacheAwareRouter
from scheduler.baselines.flowkv import FlowKVRouter
from scheduler.baselines.radix import RadixTree
from scheduler.baselines.round_robin import RoundRobinRouter
from scheduler.baselines.strict_locality import PoolFull, StrictLocalityPlacement, place
from scheduler.baselines.xpyd import XPyDRouter

W = ["w0", "w1", "w2"]


def _router(**kw):
    return CacheAwareRouter(W, **kw)


def _fill(router, worker, n, prefix):
    """Put ``n`` in-flight requests on ``worker`` (directly, bypassing routing)."""
    for k in range(n):
        rid = f"fill-{worker}-{prefix}-{k}"
        router._flight.add(rid, worker)


# -- radix tree -----------------------------------------------------------------

def test_radix_match_split_and_sizes():
    t = RadixTree()
    t.insert([1, 2, 3, 4], "a", 1.0)
    t.insert([1, 2, 5], "b", 2.0)
    assert t.sizes == {"a": 4, "b": 3}
    assert t.match([1, 2, 3, 9]) == (3, {"a": 1.0})
    n, tenants = t.match([1, 2, 7])
    assert n == 2 and tenants == {"a": 1.0, "b": 2.0}
    assert t.match([1, 2, 3, 4], tenant="b")[0] == 2
    assert t.match([9])[0] == 0
    t.insert([1, 2, 3, 4], "a", 3.0)  # duplicate insert adds nothing
    assert t.sizes["a"] == 4


# -- cache-aware router ------------------------------------------------------------

def test_hit_above_threshold_goes_to_matching_worker():
    r = _router()
    first = r.route("r0", list(range(100)))
    assert first == "w0"  # all idle, empty tree: least loaded, first in order
    r.finish("r0")
    _fill(r, "w0", 3, "a")  # w0 is now the busiest, still balanced
    # 40 of 100 tokens match (0.4 > 0.3): stays on w0 despite its load
    assert r.route("r1", list(range(40)) + list(range(1000, 1060))) == "w0"
    assert r.last_reason == "hit"


def test_match_rate_threshold_is_strict_and_miss_goes_to_least_loaded():
    r = _router()
    r.route("r0", list(range(30)))
    assert r.best_match(list(range(30)) + list(range(500, 570)))[1] == pytest.approx(0.3)
    # exactly 0.3 is not > 0.3: a miss -> least loaded (w1, first idle one)
    assert r.route("r1", list(range(30)) + list(range(500, 570))) == "w1"
    assert r.last_reason == "miss"
    # a fresh prefix: least loaded among w2 (0), w0 (1), w1 (1)
    assert r.route("r2", [7, 7, 7]) == "w2"


def test_miss_smallest_tree_policy():
    r = _router(miss_policy="smallest_tree")
    r.route("a", list(range(50)))          # w0: 50 tokens (tree empty -> w0 first)
    r.route("b", list(range(100, 110)))    # smallest tree: w1 (0 tokens)
    r.route("c", list(range(200, 205)))    # smallest tree: w2 (0 tokens)
    assert {w: r.tree_size(w) for w in W} == {"w0": 50, "w1": 10, "w2": 5}
    # load-wise w0/w1/w2 all hold 1, the miss goes to the smallest tree, w2
    r.finish("c")
    _fill(r, "w2", 2, "x")  # w2 busiest now; smallest_tree ignores load
    assert r.route("d", list(range(300, 310))) == "w2"
    assert r.last_reason == "miss"
    with pytest.raises(ValueError):
        _router(miss_policy="random")


def test_imbalance_needs_both_thresholds():
    prompt = list(range(100))
    # abs met (100 - 0 > 64), rel met (100 > 1.5 * 0): imbalanced -> least loaded
    r = _router()
    r.route("p", prompt)  # w0 caches the prompt
    _fill(r, "w0", 99, "a")
    assert r.is_imbalanced()
    assert r.route("q", prompt) == "w1" and r.last_reason == "imbalanced"
    # neither met: loads 170 / 120 / 120
    r = _router()
    r.route("p", prompt)
    _fill(r, "w0", 169, "a")
    _fill(r, "w1", 120, "b")
    _fill(r, "w2", 120, "c")
    assert r.loads() == {"w0": 170, "w1": 120, "w2": 120}  # 50 <= 64: abs not met
    assert not r.is_imbalanced()
    assert r.route("q", prompt) == "w0" and r.last_reason == "hit"
    # rel met, abs not: 60 vs 0
    r = _router()
    r.route("p", prompt)
    _fill(r, "w0", 59, "a")
    assert not r.is_imbalanced()
    assert r.route("q", prompt) == "w0"
    # abs met (300 - 200 = 100 > 64), rel not (300 <= 1.5 * 200)
    r = _router()
    r.route("p", prompt)
    _fill(r, "w0", 299, "a")
    _fill(r, "w1", 200, "b")
    _fill(r, "w2", 200, "c")
    assert not r.is_imbalanced()
    assert r.route("q", prompt) == "w0"


def test_imbalanced_route_still_updates_tree_and_finish_restores_load():
    r = _router()
    _fill(r, "w0", 65, "a")
    assert r.route("q", [5, 6, 7]) == "w1"
    assert r.cached_prefix_len([5, 6, 7], "w1") == 3
    assert r.loads()["w1"] == 1
    assert r.finish("q") == "w1" and r.loads()["w1"] == 0
    r.route("dup", [1])
    with pytest.raises(ValueError):
        r.route("dup", [1])


def test_eviction_removes_lru_leaves_of_the_overfull_worker_only():
    t = iter(range(1, 100))
    r = _router(max_tree_size=6, clock=lambda: float(next(t)))
    r.route("a", [1, 2, 3, 4])     # t=1 -> w0
    r.route("b", [1, 2, 9, 9])     # t=2: match 0.5 > 0.3 -> w0 (balanced)
    r.route("c", [1, 2, 3, 4, 5])  # t=3 -> w0, touches the [1,2,3,4] path again
    r.route("d", [50, 51, 52, 53, 54, 55, 56])  # miss -> w1 (7 tokens > 6 too)
    assert r.tree_size("w0") == 7 and r.tree_size("w1") == 7
    r.tree.insert([60, 61], "w2", 10.0)
    evicted = r.evict()
    # w0's LRU leaf is [1,2,9,9] (last used t=2); dropping its 2-token edge fits
    assert evicted["w0"] == [(1, 2, 9, 9)]
    assert r.tree_size("w0") == 5
    assert r.cached_prefix_len([1, 2, 3, 4, 5], "w0") == 5
    assert r.cached_prefix_len([1, 2, 9, 9], "w0") == 2
    assert evicted["w1"] == [(50, 51, 52, 53, 54, 55, 56)] and r.tree_size("w1") == 0
    assert "w2" not in evicted and r.tree_size("w2") == 2


def test_eviction_walks_up_to_parents_in_lru_order():
    t = iter(range(1, 100))
    r = _router(max_tree_size=2, clock=lambda: float(next(t)))
    r.route("a", [1, 2, 3])   # t=1
    r.route("b", [1, 2, 4])   # t=2, hit
    r.route("c", [8, 8])      # t=3, miss -> w1
    assert r.worker_of("b") == "w0"
    assert r.evict()["w0"] == [(1, 2, 3), (1, 2, 4)]
    assert r.tree_size("w0") == 2
    assert r.tree.tenant_prefixes("w0") == {(1, 2)}
    r.max_tree_size = 0
    assert r.evict()["w0"] == [(1, 2)]
    assert r.tree_size("w0") == 0


def test_eviction_keeps_other_workers_shared_prefix():
    t = iter(range(1, 100))
    r = _router(max_tree_size=100, clock=lambda: float(next(t)))
    r.route("a", [1, 2, 3, 4])  # w0
    _fill(r, "w0", 70, "x")    # imbalanced -> next goes to least loaded w1
    assert r.route("b", [1, 2, 3, 4]) == "w1"
    r.tree.evict_tenant("w0", 0)
    assert r.tree_size("w0") == 0
    assert r.cached_prefix_len([1, 2, 3, 4], "w1") == 4
    assert r.cached_prefix_len([1, 2, 3, 4], "w0") == 0


# -- round robin -------------------------------------------------------------------

def test_round_robin_cycles():
    r = RoundRobinRouter(W)
    assert [r.route(i) for i in range(7)] == W * 2 + ["w0"]
    assert r.in_flight == {"w0": 3, "w1": 2, "w2": 2}
    assert r.finish(0) == "w0" and r.in_flight["w0"] == 2


# -- xPyD --------------------------------------------------------------------------

INST = ["i0", "i1", "i2", "i3"]


def test_xpyd_roles_1p3d_and_3p1d():
    a = XPyDRouter.split(INST, "1P3D", kv_bytes_per_token=10)
    assert a.prefill_instances == ["i0"] and a.decode_instances == ["i1", "i2", "i3"]
    b = XPyDRouter.split(INST, "3P1D", kv_bytes_per_token=10)
    assert b.prefill_instances == ["i0", "i1", "i2"] and b.decode_instances == ["i3"]
    assert b.roles == {"i0": "prefill", "i1": "prefill", "i2": "prefill", "i3": "decode"}
    with pytest.raises(ValueError):
        XPyDRouter.split(INST, "2P1D", kv_bytes_per_token=10)


def test_xpyd_transfers_kv_from_p_to_d_with_bytes():
    r = XPyDRouter.split(INST, "1P3D", kv_bytes_per_token=4096)
    ts = [r.route(f"q{k}", list(range(100 + k))) for k in range(4)]
    assert all(t.src == "i0" for t in ts)
    assert [t.dst for t in ts] == ["i1", "i2", "i3", "i1"]  # least-loaded decode
    assert [t.bytes for t in ts] == [(100 + k) * 4096 for k in range(4)]
    assert r.transfers == ts
    assert all(r.roles[t.src] == "prefill" and r.roles[t.dst] == "decode" for t in ts)
    r.finish("q1")
    assert r.route("q9", [1]).dst == "i2"


def test_xpyd_prefill_follows_local_prefix_then_least_loaded():
    r = XPyDRouter.split(INST, "3P1D", kv_bytes_per_token=1)
    doc = list(range(1000))
    assert r.prefill("a", doc + [1]) == "i0"         # miss, all idle -> first
    assert r.prefill("b", [5] * 10) == "i1"          # miss -> least loaded
    assert r.prefill("c", doc + [2]) == "i0"         # longest local match, despite load
    assert r.local_hit(doc + [3], "i0") == 1000 and r.local_hit(doc, "i1") == 0
    assert r.prefill("d", [9] * 5) == "i2"
    t = r.complete_prefill("c")
    assert (t.src, t.dst, t.tokens) == ("i0", "i3", 1001)
    assert r.prefill_load == {"i0": 1, "i1": 1, "i2": 1}


def test_xpyd_local_cache_evicts_per_instance():
    r = XPyDRouter(["p0"], ["d0"], kv_bytes_per_token=1, cache_capacity_tokens=10)
    r.route("a", list(range(8)))
    r.route("b", list(range(100, 108)))
    assert r.local_hit(list(range(8)), "p0") == 0       # LRU victim
    assert r.local_hit(list(range(100, 108)), "p0") == 8


# -- strict locality ------------------------------------------------------------------

def test_strict_locality_stays_home_while_free():
    free = {"a": 5, "b": 9, "c": 9}
    assert place(5, "a", free) == ["a"] * 5
    assert place(0, "a", free) == []
    assert free == {"a": 5, "b": 9, "c": 9}  # pure


def test_strict_locality_spills_only_when_full():
    out = place(8, "a", {"a": 3, "b": 2, "c": 4})
    assert out[:3] == ["a"] * 3
    assert sorted(out[3:]) == ["b", "b", "c", "c", "c"]
    assert out[3] == "c"  # spill goes to the instance with the most free slots
    with pytest.raises(PoolFull):
        place(10, "a", {"a": 3, "b": 2, "c": 4})


def test_strict_locality_stateful_tracks_slots():
    p = StrictLocalityPlacement({"a": 2, "b": 2})
    assert p.place(1, "a") == ["a"]
    assert p.place(2, "a") == ["a", "b"]
    p.release("a")
    assert p.place(1, "b") == ["b"]
    assert p.place(1, "b") == ["a"]
    assert p.free == {"a": 0, "b": 0}


# -- FlowKV -----------------------------------------------------------------------

def test_flowkv_picks_least_score():
    r = FlowKVRouter(["x", "y", "z"], kv_capacity=1000)
    r.set_load("x", queued_prefill_tokens=1000, running_decodes=0, kv_used=0)
    r.set_load("y", queued_prefill_tokens=0, running_decodes=10, kv_used=0)
    r.set_load("z", queued_prefill_tokens=400, running_decodes=2, kv_used=100)
    s = r.scores()
    assert s["x"] == pytest.approx(0.5)
    assert s["y"] == pytest.approx(0.3)
    assert s["z"] == pytest.approx(0.5 * 0.4 + 0.3 * 0.2 + 0.2 * 0.1)
    assert r.choose() == "z"
    assert r.route(600) == "z"
    assert r.load["z"].queued_prefill_tokens == 1000
    assert r.choose() == "y"


def test_flowkv_feedback_and_idle_tie():
    r = FlowKVRouter(["x", "y"], kv_capacity=100)
    assert r.route(50) == "x"  # all idle: first in order
    assert r.route(50) == "y"  # x now has the whole prefill queue
    r2 = FlowKVRouter(["x", "y"], kv_capacity=100)
    r2.route(50)
    r2.prefill_done("x", 50)
    assert r2.load["x"].running_decodes == 1 and r2.load["x"].kv_used == 50
    assert r2.route(10) == "y"
    r2.decode_done("x", 50)
    assert r2.load["x"].kv_used == 0


# -- radix tree invariants (property) ---------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=6),
                          st.sampled_from(["a", "b"]), st.booleans()), max_size=25))
def test_radix_sizes_and_ancestor_invariant(ops):
    t = RadixTree()
    held = {"a": set(), "b": set()}
    for now, (tokens, tenant, evict) in enumerate(ops):
        if evict:
            t.evict_tenant(tenant, 3)
        else:
            t.insert(tokens, tenant, float(now))
        for w in ("a", "b"):
            nodes = [n for n in t._nodes() if n is not t.root and w in n.last_used]
            assert t.sizes.get(w, 0) == sum(len(n.key) for n in nodes)
            for n in nodes:  # a tenant at a node is at all its ancestors
                assert n.parent is t.root or w in n.parent.last_used
        if not evict:
            held[tenant].add(tuple(tokens))
            assert t.match(tokens, tenant=tenant)[0] == len(tokens)
    assert all(t.sizes.get(w, 0) >= 0 for w in held)


# -- adapter to scheduler.api.Policy -------------------------------------------------

def test_routed_policy_pins_batches_to_router_choice():
    api = pytest.importorskip("scheduler.api")
    from scheduler.baselines.adapter import RoutedPolicy
    from tokenlake.core.cost_model import LatencyModel

    tokens = {"q0": [1, 2, 3, 4], "q1": [1, 2, 3, 5], "q2": [9, 9], "q3": [7]}
    pol = RoutedPolicy(CacheAwareRouter([0, 1]), tokens.__getitem__, name="sgl")
    lat = LatencyModel(0.01, 1e-4, 0.0, 0.0, 0.0, 0.0)
    reqs = (
        api.RequestView("q0", "prefill", 0, 4, 0.0),
        api.RequestView("q1", "prefill", 0, 4, 0.1),
        api.RequestView("q2", "prefill", 0, 2, 0.2),
    )
    snap = api.Snapshot(0.0, reqs, (), (api.InstanceView(0), api.InstanceView(1)), 0.0, lat)
    d = pol.schedule(snap)
    d.check(snap)
    # q0 -> 0 (idle, first), q1 hits q0's prefix (3/4 > 0.3) -> 0, q2 misses -> 1
    assert pol.placement == {"q0": 0, "q1": 0, "q2": 1}
    assert pol.batch_instances(d) == [0, 1]
    assert d.batches[0].request_ids == ("q0", "q1") and d.batches[0].new_tokens == (4, 4)
    assert pol.schedule(snap) == d  # same snapshot, same decision
    # q1 finished, q0 decodes, q3 arrives, instance 1 busy
    reqs2 = (api.RequestView("q3", "prefill", 0, 1, 0.3),
             api.RequestView("q0", "decode", 4, 0, 0.0),
             api.RequestView("q2", "decode", 2, 0, 0.2))
    snap2 = api.Snapshot(1.0, (reqs2[0],), reqs2[1:],
                         (api.InstanceView(0), api.InstanceView(1, busy=True)), 0.0, lat)
    d2 = pol.schedule(snap2)
    d2.check(snap2)
    assert pol.router.loads() == {0: 2, 1: 1}  # q1 finished; q3 missed -> tie -> 0
    assert pol.placement["q3"] == 0
    assert [(b.phase, b.request_ids) for b in d2.batches] == [("prefill", ("q3",))]


# -- TokenLake with fixed P:D --------------------------------------------------------

class _Greedy:
    """All prefill requests in one batch on every free instance, decodes one batch each."""

    name = "greedy"

    def __init__(self):
        self.seen = []

    def schedule(self, snap):
        from scheduler.api import BatchDecision, Decision
        self.seen.append(({r.request_id for r in snap.requests}, snap.free_instances))
        pre = [r for r in snap.requests if r.phase == "prefill"]
        dec = [r for r in snap.requests if r.phase == "decode"]
        out = []
        if pre:
            out.append(BatchDecision(tuple(r.request_id for r in pre), "prefill",
                                     snap.free_instances,
                                     tuple(r.remaining_prefill for r in pre)))
        for r in dec[: snap.free_instances - len(out)]:
            out.append(BatchDecision((r.request_id,), "decode", 1, (1,)))
        return Decision(tuple(out))


@pytest.mark.parametrize("config,p,d", [("1P3D", 1, 3), ("3P1D", 3, 1)])
def test_fixed_pd_restricts_roles(config, p, d):
    api = pytest.importorskip("scheduler.api")
    from scheduler.baselines.fixed_pd import FixedPD
    from tokenlake.core.cost_model import LatencyModel

    inner = _Greedy()
    pol = FixedPD.split([0, 1, 2, 3], config, inner)
    assert pol.name == f"greedy-{config}"
    lat = LatencyModel(0.01, 1e-4, 0.0, 0.0, 0.0, 0.0)
    reqs = tuple(api.RequestView(f"p{k}", "prefill", 0, 10, 0.0) for k in range(2)) + tuple(
        api.RequestView(f"d{k}", "decode", 5, 0, 0.0) for k in range(4))
    snap = api.Snapshot(0.0, reqs[:2], reqs[2:], tuple(api.InstanceView(i) for i in range(4)),
                        0.0, lat)
    dec = pol.schedule(snap)
    dec.check(snap)
    assert inner.seen == [({"p0", "p1"}, p), ({"d0", "d1", "d2", "d3"}, d)]
    pre = [b for b in dec.batches if b.phase == "prefill"]
    dcd = [b for b in dec.batches if b.phase == "decode"]
    assert sum(b.dop for b in pre) == p and len(dcd) == d
    assert pol.allowed_instances(pre[0]) == tuple(range(p))
    assert pol.allowed_instances(dcd[0]) == tuple(range(p, 4))


def test_fcfs_decode_batch_first_then_prefills_in_arrival_order():
    from scheduler import api
    from scheduler.baselines.fcfs import FCFS
    from tokenlake.core.cost_model import LatencyModel

    lat = LatencyModel(1e-3, 1e-4, 0.0, 0.0, 0.0, 0.0)
    running = (api.RequestView("d1", "decode", 40, 0, 0.0), api.RequestView("p1", "prefill", 16, 100, 0.5),
               api.RequestView("d2", "decode", 70, 0, 0.1))
    waiting = (api.RequestView("w2", "prefill", 0, 30, 3.0), api.RequestView("w1", "prefill", 0, 900, 2.0))
    snap = api.Snapshot(4.0, waiting, running, tuple(api.InstanceView(i) for i in range(3)), 0.0, lat)
    d = FCFS(chunk_tokens=64).schedule(snap)
    d.check(snap)
    assert [(b.phase, b.request_ids, b.new_tokens, b.dop) for b in d.batches] == [
        ("decode", ("d1", "d2"), (1, 1), 1),
        ("prefill", ("p1",), (64,), 1),  # a running prefill continues before new ones
        ("prefill", ("w1",), (64,), 1),  # w1 arrived before w2; no instance left for w2
    ]
    busy = api.Snapshot(4.0, waiting, (), (api.InstanceView(0, busy=True),), 0.0, lat)
    assert FCFS().schedule(busy).batches == ()
    # A fixed prefill DoP: as many instances as are left, never more rows than tokens.
    wide = api.Snapshot(4.0, waiting + (api.RequestView("w3", "prefill", 0, 2, 4.0),), running,
                        tuple(api.InstanceView(i) for i in range(6)), 0.0, lat)
    d = FCFS(chunk_tokens=64, prefill_dop=2).schedule(wide)
    d.check(wide)
    assert [(b.request_ids, b.dop) for b in d.batches] == [
        (("d1", "d2"), 1), (("p1",), 2), (("w1",), 2), (("w2",), 1)]  # 1 instance left for w2
    with pytest.raises(ValueError, match="prefill_dop"):
        FCFS(prefill_dop=0)


def test_least_load_router_picks_the_fewest_in_flight_whatever_is_cached():
    from scheduler.baselines.least_load import LeastLoadRouter

    router = LeastLoadRouter(["w0", "w1", "w2"])
    assert [router.route(f"r{i}", (1, 2, 3)) for i in range(4)] == ["w0", "w1", "w2", "w0"]
    router.finish("r1")
    assert router.route("r4", (1, 2, 3)) == "w1"  # the one with a request fewer
    with pytest.raises(ValueError):
        router.route("r4")
    with pytest.raises(ValueError):
        LeastLoadRouter([])

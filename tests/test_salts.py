"""Tenant namespaces: cache salts (issue #39, part 7; docs/design.md §4, docs/security.md).

A request may carry a ``cache_salt``; the salt starts its segments' key chain at
``SegmentHasher.salt_root(salt)`` and its sequences hang under that salt's own virtual
root in the prefix tree. Two salts never share a segment (no match, no dedup, no page
hit, no tail across them); the same salt does; no salt is today's keys bit for bit.
Mostly the pure control plane with the core's own objects; then the same over
``tokenlake.connect``, the vLLM connector's scheduler side, and one HTTP test with the
real model (``cached_tokens`` per salt, greedy answers equal the reference engine's).
"""

from __future__ import annotations

import hashlib
import random

import httpx
import pytest
from dataplane_util import TINY, ManualClock
from test_http import _reference_text, client, model, served  # noqa: F401  (fixtures)

import tokenlake
from tokenlake.core.config import PoolConfig
from tokenlake.core.control import ControlPlane
from tokenlake.core.errors import (
    CapacityError,
    ConfigError,
    PlanError,
    PrefixNotCached,
    SegmentNotFound,
)
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.prefix_tree import PrefixTree
from tokenlake.core.segments import MAX_SALT_CHARS, SegmentHasher
from tokenlake.core.specs import load_model
from tokenlake.dataplane import messages as m
from tokenlake.dataplane import wire
from tokenlake.dataplane.wire import Kind
from tokenlake.service.serve import SERVED_MODEL

MODEL = load_model("smollm2-135m")
P = tuple(range(1, 15))  # 14 tokens: 3 segments of 4 and a 2-token tail
BAD_SALTS = (5, b"A", "x" * (MAX_SALT_CHARS + 1), "\ud800")


def make_cp(c=4, slots=64, instances=(0, 1, 2, 3), **kw) -> ControlPlane:
    cfg = PoolConfig(segment_tokens=c, namespace="salt-model", slots_per_instance=slots, **kw)
    return ControlPlane(cfg, MODEL, list(instances), clock=ManualClock(), rng=random.Random(0))


def run(cp, *reqs, phase="prefill"):
    """Plans one iteration of ``reqs`` (one batch) and reports it stored."""
    plans = cp.gen_plans([Batch(tuple(reqs), phase)], [1])
    cp.complete(plans)
    return plans


def state(cp) -> tuple:
    """The tree (every node, its roots) and the request table, comparable with ``==``."""
    tree = cp.get_prefix_tree()
    nodes = {k: (tree.parent(k), tree.index(k), tree.replicas(k, False), tree.lease_count(k))
             for k in tree.keys()}
    reqs = {s.request_id: (list(s.chain), s.salt, s.tail, list(s.tail_tokens))
            for s in cp.requests.states()}
    return nodes, tree.roots(), reqs, cp.stats()


# ------------------------------------------------------------------------ keys


def test_a_salt_root_is_a_keyed_blake2b_and_no_salt_keeps_todays_keys():
    h = SegmentHasher(4, "salt-model")
    want = hashlib.blake2b("tenant-α".encode(), digest_size=16, key=h.root,
                           person=b"tokenlake-salt").digest()
    assert h.salt_root("tenant-α") == want
    assert h.salt_root(None) == h.salt_root("") == h.root
    assert h.keys(P, parent=h.salt_root("")) == h.keys(P)
    a, b = h.keys(P, parent=h.salt_root("A")), h.keys(P, parent=h.salt_root("B"))
    assert len(a) == 3 and not set(a) & set(b) and not set(a) & set(h.keys(P))
    # the same salt of another model (namespace) is another root
    assert SegmentHasher(4, "other-model").salt_root("A") != h.salt_root("A")
    assert h.salt_root("x" * MAX_SALT_CHARS) != h.salt_root("x" * (MAX_SALT_CHARS - 1))
    tree = PrefixTree(h)
    for bad in BAD_SALTS:
        with pytest.raises(PlanError):
            h.salt_root(bad)
        with pytest.raises(PlanError):
            tree.match(P, salt=bad)


# ------------------------------------------------------------- the control plane


def test_two_salts_never_share_a_segment_and_the_same_salt_does():
    cp = make_cp()
    tree, h = cp.get_prefix_tree(), cp.pool.hasher
    root_a, root_b = h.salt_root("A"), h.salt_root("B")
    keys_a, keys_b = h.keys(P, parent=root_a), h.keys(P, parent=root_b)
    run(cp, BatchRequest("a1", P, cache_salt="A"))
    cp.finish_request("a1")
    assert tree.match(P, salt="A").keys == tuple(keys_a)
    assert tree.parent(keys_a[0]) == root_a and tree.roots() == (None, root_a)
    assert tree.match(P).hit_tokens == 0 and tree.match(P, salt="B").hit_tokens == 0
    assert not set(h.keys(P)) & set(tree.keys())
    # B cannot declare A's segments its prefix: nothing changes
    before = state(cp)
    with pytest.raises(PrefixNotCached):
        cp.gen_plans([Batch((BatchRequest("b0", P[12:], P[:12], "B"),))], [1])
    assert state(cp) == before
    # B stores the same prompt again: new segments, no dedup across salts
    dedup = cp.stats().pool.dedup_segments
    (tp,) = run(cp, BatchRequest("b1", P, cache_salt="B")).transfer_plans
    assert [p.key for p in tp.puts if p.key] == keys_b and tp.dedup_rows == 0
    assert cp.stats().pool.dedup_segments == dedup and cp.stats().pool.segments == 6
    assert set(tree.roots()) == {None, root_a, root_b}
    # the same salt shares: a match, a declared prefix read in place, dedup
    hit = tree.match(P, max_tokens=len(P) - 1, salt="A")
    assert hit.hit_tokens == 12
    plans = run(cp, BatchRequest("a2", P[12:], P[:12], "A"))
    read = {(t.instance, s) for t in plans.query_plans[0].tasks for it in t.items for s in it.slots}
    assert read == {(loc.instance, loc.slot) for locs in hit.replicas for loc in locs}
    (tp,) = run(cp, BatchRequest("a3", P, cache_salt="A")).transfer_plans
    assert tp.dedup_rows == 12 and not [p for p in tp.puts if p.key]
    # no salt ("" too) is today's unsalted keys, under the unsalted root
    run(cp, BatchRequest("u1", P, cache_salt=""))
    assert tree.match(P).keys == tuple(h.keys(P)) and tree.parent(h.keys(P)[0]) is None
    assert tree.children(None) == (h.keys(P)[0],)
    assert tree.children(root_a) == (keys_a[0],) and tree.children(root_b) == (keys_b[0],)
    assert set(tree.first_segments()) == {keys_a[0], keys_b[0], h.keys(P)[0]}
    cp.check()


def test_a_live_request_keeps_its_salt_and_bad_salts_change_nothing():
    cp = make_cp()
    h = cp.pool.hasher
    run(cp, BatchRequest("r", P[:6], cache_salt="A"))
    before = state(cp)
    with pytest.raises(PlanError, match="another cache salt"):
        cp.gen_plans([Batch((BatchRequest("r", (7,), cache_salt="B"),), "decode")], [1])
    for bad in BAD_SALTS:
        with pytest.raises(PlanError):
            cp.gen_plans([Batch((BatchRequest("n", P, cache_salt=bad),))], [1])
        with pytest.raises(PlanError):
            cp.lease_prefix("n", P[:4], cache_salt=bad)
    assert state(cp) == before
    run(cp, BatchRequest("r", (7,)), phase="decode")  # a later iteration leaves it out
    run(cp, BatchRequest("r", (8,), cache_salt="A"), phase="decode")  # or repeats it
    assert cp.requests.get("r").chain == h.keys(P[:8], parent=h.salt_root("A"))
    run(cp, BatchRequest("u", P[:6]))
    with pytest.raises(PlanError, match="another cache salt"):  # no salt is a salt too
        cp.gen_plans([Batch((BatchRequest("u", (7,), cache_salt="A"),), "decode")], [1])
    cp.check()


def test_lease_prefix_leases_only_under_its_salt():
    cp = make_cp()
    tree, h = cp.get_prefix_tree(), cp.pool.hasher
    doc = tuple(range(40, 56))  # 4 segments
    run(cp, BatchRequest("w", doc[:12], cache_salt="A"))
    cp.finish_request("w")
    with pytest.raises(PrefixNotCached):
        cp.lease_prefix("l0", doc[:12])
    with pytest.raises(PrefixNotCached):
        cp.lease_prefix("l0", doc[:12], cache_salt="B")
    locs = cp.lease_prefix("l1", doc[:12], cache_salt="A")
    match = tree.match(doc[:12], salt="A")
    assert len(locs) == 3 and all(loc in reps for loc, reps in zip(locs, match.replicas))
    assert cp.requests.get("l1").salt == "A"
    (tp,) = run(cp, BatchRequest("l1", doc[12:])).transfer_plans  # chains on under A
    assert [p.key for p in tp.puts] == [h.keys(doc, parent=h.salt_root("A"))[3]]
    cp.finish_request("l1")
    assert cp.live_requests == ()
    cp.check()


def test_page_hits_and_finished_tails_stay_under_their_salt():
    cp = make_cp(c=8, page_tokens=2)
    tree, h = cp.get_prefix_tree(), cp.pool.hasher
    root_a = h.salt_root("A")
    doc = tuple(range(100, 113))  # a segment and a 5-token tail
    run(cp, BatchRequest("a", doc, cache_salt="A"))
    cp.finish_request("a")
    first = h.keys(doc[:8], parent=root_a)[0]
    assert h.tail_key(doc[8:], first) in tree  # the tail stayed, after A's segment
    probe = doc[:12] + (999,)
    assert tree.match(probe, 12, salt="A").hit_tokens == 12  # 8 + two pages of the tail
    assert tree.match(probe, 12).hit_tokens == tree.match(probe, 12, salt="B").hit_tokens == 0
    # a tail with nothing before it hangs under the salt's root
    short = tuple(range(300, 306))
    run(cp, BatchRequest("s", short, cache_salt="A"))
    cp.finish_request("s")
    tail = h.tail_key(short, root_a)
    assert tree.parent(tail) == root_a and tree.index(tail) == 0
    assert tree.match(short + (1,), salt="A").hit_tokens == 6
    assert tree.match(short + (1,)).hit_tokens == tree.match(short + (1,), salt="B").hit_tokens == 0
    assert tree.partial(root_a, short)[:2] == (tail, 6) and tree.partial(None, short) is None
    # the same tail unsalted is another node, under the unsalted root
    run(cp, BatchRequest("u", short))
    cp.finish_request("u")
    assert tree.parent(h.tail_key(short, None)) is None and h.tail_key(short, None) != tail
    # a page hit is admitted only under its salt: A's copies A's tail
    with pytest.raises(PrefixNotCached):
        cp.gen_plans([Batch((BatchRequest("b", (7,), short[:4], "B"),))], [1])
    (tp,) = run(cp, BatchRequest("a2", (7,), short[:4], "A")).transfer_plans
    (src,) = tree.replicas(tail)
    assert [(c.src_instance, c.src_slot, c.tokens) for c in tp.copies] == [(src.instance, src.slot, 4)]
    # a page hit inside a whole segment, across salts
    run(cp, BatchRequest("d", tuple(range(500, 516)), cache_salt="A"))
    near = tuple(range(500, 512)) + (0, 0, 0, 0)
    assert tree.match(near, salt="A").hit_tokens == 12 and tree.match(near).hit_tokens == 0
    cp.check()


def test_evicting_the_last_segment_under_a_salt_drops_its_root_and_a_rollback_restores_it():
    cp = make_cp(slots=2, instances=(0,))
    tree, h = cp.get_prefix_tree(), cp.pool.hasher
    root_a = h.salt_root("A")
    run(cp, BatchRequest("a", P[:4], cache_salt="A"))
    cp.finish_request("a")
    assert tree.roots() == (None, root_a)
    # "u" takes the free slot and evicts A's segment, then "v" finds no slot: all undone
    before = state(cp)
    with pytest.raises(CapacityError):
        cp.gen_plans([Batch((BatchRequest("u", tuple(range(20, 28))),
                             BatchRequest("v", tuple(range(30, 34)))))], [1])
    assert state(cp) == before and tree.match(P, salt="A").hit_tokens == 4
    cp.check()
    run(cp, BatchRequest("u", tuple(range(20, 28))))  # evicts it for good
    assert cp.stats().pool.evictions == 1
    assert tree.roots() == (None,) and tree.match(P, salt="A").hit_tokens == 0
    with pytest.raises(SegmentNotFound):
        tree.children(root_a)
    cp.check()


def test_a_tree_drops_a_salts_root_with_its_last_node():
    tree = PrefixTree(SegmentHasher(2, "salt-tree"))
    h = tree.hasher
    root = tree.root_key("A")
    k0, k1 = h.keys([1, 2, 3, 4], parent=root)
    tree.insert(k0, root, 0, [1, 2])
    tree.insert(k1, k0, 1, [3, 4])
    for k, slot in ((k0, 0), (k1, 1)):
        tree.add_replica(k, 0, slot, 0.0, ready=True)
    tree.check()
    assert tree.roots() == (None, root) and tree.match([1, 2, 3, 4], salt="A").keys == (k0, k1)
    with pytest.raises(ValueError):  # the unsalted root is None, never its key
        tree.insert(b"\x07" * 16, h.root, 0)
    with pytest.raises(ValueError):  # a first segment follows a root, not a segment
        tree.insert(b"\x07" * 16, k0, 0)
    tree.remove_replica(k1, 0)
    assert tree.roots() == (None, root)
    tree.remove_replica(k0, 0)
    assert tree.roots() == (None,) and len(tree) == 0
    tree.check()
    tree.insert(k0, root, 0, [1, 2])  # back again
    assert tree.roots() == (None, root) and tree.children(root) == (k0,)
    assert tree.remove_subtree(k0) == [] and tree.roots() == (None,)
    tree.check()


def test_heavy_hitters_under_a_salt_are_replicated():
    now = [0.0]
    cfg = PoolConfig(4, "salt-rep", 4, window_s=100.0, bucket_s=100.0)
    cp = ControlPlane(cfg, MODEL, [0, 1], clock=lambda: now[0], rng=random.Random(0))
    run(cp, BatchRequest("w", P[:4], cache_salt="A"))
    cp.finish_request("w")
    tree = cp.get_prefix_tree()
    (key,) = tree.match(P, salt="A").keys
    (src,) = tree.replicas(key)
    cp.record_reads([((key,), {src.instance: 1})], iterations=50)
    started = cp.rebalance()
    assert [(r.key, r.target.instance) for r in started] == [(key, 1 - src.instance)]
    cp.finish_replication(started[0])
    assert {loc.instance for loc in tree.replicas(key)} == {0, 1}
    cp.check()


# ------------------------------------------------------------------ the wire


def test_the_salt_fields_are_optional_on_the_wire():
    def round_trip(kind, body):
        return m.parse(wire.decode(wire.encode(kind, 1, body)))

    match = m.CpMatch((1, 2, 3), 2, "A")
    assert round_trip(Kind.CP_MATCH, match.body()) == match
    assert round_trip(Kind.CP_MATCH, {"tokens": [1, 2, 3], "max_tokens": 2}).salt is None
    lease = m.CpLeasePrefix("r", (1, 2), "A")
    assert round_trip(Kind.CP_LEASE_PREFIX, lease.body()) == lease
    assert round_trip(Kind.CP_LEASE_PREFIX, {"request_id": "r", "tokens": [1]}).cache_salt is None
    gen = m.CpGenPlans((Batch((BatchRequest("a", (1,), (), "A"), BatchRequest("b", (2,)))),), (1,), None)
    got = round_trip(Kind.CP_GEN_PLANS, gen.body())
    assert got == gen and [r.cache_salt for r in got.batches[0].requests] == ["A", None]


@pytest.fixture(scope="module")
def tiny_served():
    from tokenlake.deploy.local import LocalCluster
    from tokenlake.service.server import ControlServer

    with LocalCluster(2, TINY, 8 << 20, segment_tokens=8, max_rows=64) as cluster, \
            ControlServer(cluster) as server:
        yield cluster, server


def test_salts_over_tokenlake_connect_behave_as_in_process(tiny_served):
    cluster, server = tiny_served
    tokens = tuple(range(700, 719))  # 2 segments of 8 and 3 more (metadata only)
    local, h = cluster.control.get_prefix_tree(), cluster.control.pool.hasher
    with tokenlake.connect(server.address, credentials=server.credentials()) as cp:
        cp.complete(cp.gen_plans([Batch((BatchRequest("w", tokens, cache_salt="A"),))], [1]))
        cp.finish_request("w")
        remote = cp.get_prefix_tree()
        for salt in (None, "", "A", "B"):
            assert remote.match(tokens, len(tokens) - 1, salt=salt) == \
                local.match(tokens, len(tokens) - 1, salt=salt)
        assert remote.match(tokens, salt="A").keys == tuple(h.keys(tokens, parent=h.salt_root("A")))
        assert remote.match(tokens).hit_tokens == 0
        with pytest.raises(PlanError):
            remote.match(tokens, salt="x" * (MAX_SALT_CHARS + 1))
        with pytest.raises(PrefixNotCached):
            cp.lease_prefix("l0", tokens[:16])
        with pytest.raises(PrefixNotCached):
            cp.lease_prefix("l0", tokens[:16], cache_salt="B")
        locs = cp.lease_prefix("l1", tokens[:16], cache_salt="A")
        assert locs == tuple(reps[0] for reps in local.match(tokens[:16], salt="A").replicas)
        with pytest.raises(PlanError, match="another cache salt"):
            cp.gen_plans([Batch((BatchRequest("l1", (1,), cache_salt="B"),))], [1])
        cp.finish_request("l1")
    assert cluster.control.live_requests == ()
    cluster.control.check()


def test_the_vllm_connector_matches_leases_and_stores_under_its_salts(tmp_path):
    """The scheduler side of ``TokenLakeConnector`` (no vLLM engine): the instance's
    ``cache_salt`` from the extra config, a request's own ``cache_salt`` winning."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from service_util import control_served
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tokenlake.integrations.vllm import TokenLakeConnector

    c = 16
    doc = tuple(range(1000, 1000 + 3 * c))
    with control_served(TINY, 1, 8 << 20, c, 64, "vllm-cpu") as (cluster, server):
        control, h = server.shared_control(), cluster.control.pool.hasher
        control.complete(control.gen_plans([Batch((BatchRequest("seed", doc[:2 * c], (), "inst"),))], [1]))
        control.finish_request("seed")
        cfg = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(engine_id="salts", kv_connector_extra_config={
                "address": server.address, "cache_salt": "inst"}),
            cache_config=SimpleNamespace(block_size=c))
        conn = TokenLakeConnector(cfg, KVConnectorRole.SCHEDULER)
        try:
            mine = SimpleNamespace(request_id="mine", prompt_token_ids=list(doc), cache_salt=None)
            own = SimpleNamespace(request_id="own", prompt_token_ids=list(doc), cache_salt="own")
            assert conn.get_num_new_matched_tokens(mine, 0) == (2 * c, False)
            assert conn.get_num_new_matched_tokens(own, 0) == (0, False)
            long = SimpleNamespace(request_id="long", prompt_token_ids=list(doc),
                                   cache_salt="y" * (MAX_SALT_CHARS + 1))
            assert conn.get_num_new_matched_tokens(long, 0) == (0, False)  # its digest's
            assert conn.requests.salts["long"].startswith("blake2b:")
            conn.request_finished(long, [])
            blocks = SimpleNamespace(get_block_ids=lambda: ([0, 1, 2],))
            conn.update_state_after_alloc(mine, blocks, 2 * c)  # leases under "inst"
            conn.update_state_after_alloc(own, blocks, 0)
            store = conn.strategy.plan_store({"mine": len(doc), "own": len(doc)})
            conn.cp.complete(store.plans)
            tree = cluster.control.get_prefix_tree()
            assert tree.match(doc, salt="inst").keys == tuple(h.keys(doc, parent=h.salt_root("inst")))
            assert tree.match(doc, salt="own").keys == tuple(h.keys(doc, parent=h.salt_root("own")))
            assert tree.match(doc).hit_tokens == 0
            for req in (mine, own):
                conn.request_finished(req, [])
            assert cluster.control.live_requests == ()
        finally:
            conn.shutdown()
        with pytest.raises(ConfigError, match="cache_salt"):
            cfg.kv_transfer_config.kv_connector_extra_config["cache_salt"] = "x" * 300
            TokenLakeConnector(cfg, KVConnectorRole.SCHEDULER)
        cluster.control.check()


# ------------------------------------------------------------- HTTP, real model


def test_http_cache_salt_counts_hits_per_tenant_and_answers_are_the_references(
        model, served, client):  # noqa: F811
    _, tok, _ = model
    ids = tok.encode("The lighthouse keeper of Salt Reach logs every ship that passes the "
                     "northern cape: its name, its flag, its cargo, its crew, the hour of the "
                     "tide and the colour of the sky. This morning she wrote that")
    assert len(ids) > 2 * 16
    want, _ = _reference_text(model, ids, 6)

    def ask(salt):
        out = client.completions.create(model=SERVED_MODEL, prompt=ids, max_tokens=6,
                                        temperature=0, extra_body={"cache_salt": salt})
        return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens

    assert ask("tenant-a") == (want, 0)
    assert ask("tenant-b") == (want, 0)  # tenant a's segments are not b's
    text, cached = ask("tenant-a")
    assert text == want and cached >= 2 * 16
    for bad in ("", "x" * (MAX_SALT_CHARS + 1), 5):
        r = httpx.post(served.http.url + "/v1/completions", timeout=30, json={
            "model": SERVED_MODEL, "prompt": ids, "max_tokens": 1, "cache_salt": bad})
        assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"], r.text

"""Page-exact prefix matching, home placement under a full pool and replication that
evicts colder replicas (issue #19), on the control plane's own structures."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from token_util import common_prefix

from tokenlake.core.config import PoolConfig
from tokenlake.core.control import ControlPlane
from tokenlake.core.errors import ConfigError, PlanError
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.pool import CachePool
from tokenlake.core.specs import load_model

C = 8


def _control(page: int, instances=(0, 1, 2), slots: int = 64, clock=lambda: 0.0) -> ControlPlane:
    config = PoolConfig(C, "page-test", slots, page_tokens=page)
    return ControlPlane(config, load_model("llama-2-7b"), list(instances), clock=clock,
                        rng=random.Random(0))


def _store(cp: ControlPlane, rid: str, tokens) -> None:
    """One prefill of ``tokens`` (reusing what the pool has), then finish: the pool keeps
    its whole segments and its last partial segment as a tail."""
    tokens = tuple(tokens)
    hit = cp.get_prefix_tree().match(tokens, max_tokens=len(tokens) - 1).hit_tokens
    cp.complete(cp.gen_plans([Batch((BatchRequest(rid, tokens[hit:], tokens[:hit]),))], [1]))
    cp.finish_request(rid)
    cp.check()


# A small alphabet, so that prompts share prefixes of every length.
SEQ = st.lists(st.integers(0, 2), min_size=1, max_size=4 * C)


# Ids past 65,535: the tree stores tokens in 4 bytes from the first one on.
WIDE_SEQ = st.lists(st.sampled_from([0, 1, 70_000, 2**31 - 1]), min_size=1, max_size=4 * C)


@settings(max_examples=60, deadline=None)
@given(stored=st.lists(SEQ, min_size=1, max_size=6), queries=st.lists(SEQ, min_size=1, max_size=6),
       page=st.sampled_from([1, 2, 4, C]))
def test_match_is_the_longest_stored_prefix_in_whole_pages(stored, queries, page):
    """Against a brute-force oracle: after storing some prompts, a prompt's match is its
    longest common prefix with any stored one, in whole pages (whole segments only when
    the page is C), and the partial pages come from a segment whose tokens equal them."""
    _check_against_oracle(stored, queries, page)


@settings(max_examples=40, deadline=None)
@given(stored=st.lists(st.one_of(SEQ, WIDE_SEQ), min_size=1, max_size=6),
       queries=st.lists(st.one_of(SEQ, WIDE_SEQ), min_size=1, max_size=6),
       page=st.sampled_from([1, 4]))
def test_large_token_ids_match_exactly_before_and_after_the_tree_widens(stored, queries, page):
    _check_against_oracle(stored, queries, page)


def _check_against_oracle(stored, queries, page):
    cp = _control(page)
    for i, s in enumerate(stored):
        _store(cp, f"s{i}", s)
    tree = cp.get_prefix_tree()
    for q in queries:
        m = tree.match(q)
        longest = max(common_prefix(q, s) for s in stored)
        want = longest // page * page if page < C else longest // C * C
        if page < C:
            want = min(want, longest // page * page)
        assert m.hit_tokens == want, (q, stored, page)
        assert m.whole_tokens == len(m.keys) * C == m.hit_tokens // C * C
        if m.partial_key is not None:
            seg = tree.tokens(m.partial_key)
            n = m.partial_tokens
            assert 0 < n < C and n % page == 0
            got = [int.from_bytes(seg[4 * i: 4 * i + 4], "little", signed=True) for i in range(n)]
            assert got == list(q[m.whole_tokens: m.whole_tokens + n])  # exact, token for token


def test_a_page_hit_needs_a_ready_segment_and_max_tokens_caps_it():
    cp = _control(page=2)
    doc = tuple(range(3 * C))
    # A prefill in flight: its segments are pending, no page of them hits yet.
    plans = cp.gen_plans([Batch((BatchRequest("a", doc),))], [1])
    assert cp.get_prefix_tree().match(doc[: C + 4]).hit_tokens == 0
    cp.complete(plans)
    cp.finish_request("a")
    tree = cp.get_prefix_tree()
    assert tree.match(doc[: C + 5]).hit_tokens == C + 4  # whole pages only
    assert tree.match(doc[: C + 5], max_tokens=C + 3).hit_tokens == C + 2


@settings(max_examples=100, deadline=None)
@given(stored=st.lists(SEQ, min_size=1, max_size=5), pending=st.lists(SEQ, min_size=1, max_size=5),
       queries=st.lists(SEQ, min_size=1, max_size=6), page=st.sampled_from([1, 2, 4]))
# what it found in the page search before the fix: the ready tail [2, 2] beyond a pending [2, 0, ...]
@example(stored=[[2, 2]], pending=[[2] + [0] * (C - 1)], queries=[[2, 1]], page=1)
def test_segments_being_stored_change_no_match_and_a_hit_holds_for_its_own_prefix(
        stored, pending, queries, page):
    """Beside segments being stored (prefills in flight), a match is still the longest
    common prefix with what is ready, in whole pages; and the prefix a match gives is
    matched whole again on its own (a serving loop admits a request with the hit of its
    whole prompt by matching that prefix alone)."""
    cp = _control(page)
    for i, s in enumerate(stored):
        _store(cp, f"s{i}", s)
    tree = cp.get_prefix_tree()
    for i, p in enumerate(pending):  # their new segments stay pending
        p = tuple(p)
        hit = tree.match(p, max_tokens=len(p) - 1).hit_tokens
        try:
            cp.gen_plans([Batch((BatchRequest(f"p{i}", p[hit:], p[:hit]),))], [1])
        except PlanError:  # its new tokens complete a segment another prefill stores
            pass
    for q in queries:
        m = tree.match(q)
        longest = max(common_prefix(q, s) for s in stored)
        assert m.hit_tokens == longest // page * page, (q, stored, pending, page)
        assert tree.match(tuple(q)[: m.hit_tokens]).hit_tokens == m.hit_tokens, (q, stored, pending)


def test_a_page_hit_finds_the_ready_segment_among_pending_ones_that_share_its_pages():
    """Three segments start with the same page; the middle one in token order is ready,
    the others are being stored. Every prompt starting with that page hits it, however
    short: the children next to the prompt in token order are the pending ones, and the
    ready one lies further (it used to be missed, so that a request admitted with the hit
    its whole prompt gave was refused for the same hit on its prefix alone)."""
    cp = _control(page=2)
    page = (5, 6)
    ready = page + (2,) * (C - 2)
    _store(cp, "ready", ready + (9,))
    for rid, x in (("low", 1), ("high", 3)):  # their prefills in flight: pending segments
        cp.gen_plans([Batch((BatchRequest(rid, page + (x,) * (C - 2)),))], [1])
    tree = cp.get_prefix_tree()
    for q in (page, page + (0,), page + (1,), page + (1, 1), page + (3, 3, 3), page + (4,)):
        m = tree.match(q)
        assert (m.hit_tokens, m.partial_key) == (2, tree.match(ready).keys[0]), q
    assert tree.match(page + (2, 2, 7)).hit_tokens == 4


def test_page_tokens_must_divide_the_segment_and_default_to_16():
    assert PoolConfig(64, "x", 4).page_tokens == 16
    assert PoolConfig(24, "x", 4).page_tokens == 24  # 16 does not divide 24: whole segments
    assert PoolConfig(24, "x", 4, page_tokens=1).page_tokens == 1
    with pytest.raises(ConfigError):
        PoolConfig(24, "x", 4, page_tokens=5)


def test_a_diverging_request_stores_its_own_segment_for_later_requests():
    """B leaves A's second segment after 3 pages: it reads those pages in place once,
    its open tail gets them by a page copy on the same instance, then its own tokens;
    its segment seals under its own key and C, following B further, hits it whole."""
    cp = _control(page=2)
    a = tuple(range(100, 100 + 3 * C))
    _store(cp, "a", a)
    b = a[: C + 6] + (7, 7, 7, 7, 7, 7, 7, 7, 7, 7)
    tree = cp.get_prefix_tree()
    m = tree.match(b, max_tokens=len(b) - 1)
    assert (m.whole_tokens, m.partial_tokens) == (C, 6)
    plans = cp.gen_plans([Batch((BatchRequest("b", b[C + 6:], b[: C + 6]),))], [1])
    ((copy,),) = [tp.copies for tp in plans.transfer_plans]
    src = {loc.instance: loc.slot for loc in m.partial_replicas}
    assert copy.tokens == 6 and src[copy.src_instance] == copy.src_slot
    assert copy.dst_instance == copy.src_instance  # the tail lands where it reads
    (qp,) = plans.query_plans
    (tail,) = qp.tails  # this iteration reads A's segment in place, 6 tokens of it
    assert (tail.instance, tail.items[0].slots, tail.items[0].tokens) == (copy.src_instance, (copy.src_slot,), (6,))
    (tp,) = plans.transfer_plans
    own = [p for p in tp.puts if p.slot == copy.dst_slot]
    assert own and own[0].offset == 6 and own[0].instance == copy.dst_instance
    cp.complete(plans)
    cp.finish_request("b")
    cp.check()
    later = tree.match(b + (9, 9, 9))
    assert later.whole_tokens == 3 * C  # B's own segments, whole (its second one too)
    assert later.keys[1] != tree.match(a).keys[1]


def test_a_finished_tail_is_kept_for_page_hits_and_released_with_less_than_a_page():
    cp = _control(page=4)
    _store(cp, "a", tuple(range(C + 6)))  # tail of 6 tokens: kept
    _store(cp, "b", tuple(range(50, 50 + C + 3)))  # tail of 3 tokens: released
    tree = cp.get_prefix_tree()
    assert tree.match(tuple(range(C + 6)) + (99,)).hit_tokens == C + 4
    assert tree.match(tuple(range(50, 50 + C + 3)) + (99,)).hit_tokens == C
    assert len(tree) == 3 and sum(cp.pool.stats().slots_used.values()) == 3


# ---------------------------------------------------------------- placement


@pytest.mark.parametrize("choices", [1, 2])
def test_in_a_full_pool_new_segments_land_where_their_hash_places_them(choices):
    """Once the pool is full, every new segment takes the slot of the least recently
    used replica among its home and the next ``choices - 1`` instances on the ring
    (1: always the home, paper §4.3), not the global LRU victim's wherever it lives."""
    now = [0.0]
    config = PoolConfig(4, "home-test", 8, page_tokens=4, eviction_choices=choices)
    pool = CachePool(config, range(4), clock=lambda: now[0])
    rng = random.Random(3)
    homes, global_lru = [], []
    for i in range(200):
        now[0] += 1.0
        key = rng.randbytes(16)
        full = i >= 32  # the pool (4 x 8 slots) is full from here on
        if full:
            cands = list(pool.ring.preference(key))[:choices]
            victims = [pool.tree.lru_victim(inst) for inst in cands]
            ages = [pool.tree.last_access(k, inst) for k, inst in victims]
            want = cands[ages.index(min(ages))]
            oldest = pool.tree.lru_victim()
            global_lru.append(pool.tree.last_access(*oldest) == min(ages))
        placed = pool.place(key, None, 0, tuple(rng.randrange(1000) for _ in range(4)))
        pool.commit(key, placed.location.instance)
        if full:
            assert placed.location.instance == want
            assert placed.evicted is not None and placed.evicted.instance == want
            homes.append(want == pool.ring.home(key))
        pool.check()
    assert all(homes) if choices == 1 else 0 < sum(homes) < len(homes)
    assert not all(global_lru)  # the global LRU victim was elsewhere at times


def test_replication_evicts_a_colder_replica_on_a_full_target():
    now = [0.0]
    config = PoolConfig(4, "rep-full", 4, window_s=100.0, bucket_s=100.0, page_tokens=4)
    cp = ControlPlane(config, load_model("llama-2-7b"), [0, 1], clock=lambda: now[0],
                      rng=random.Random(0))
    rng = random.Random(1)
    docs = []
    for i in range(12):  # 8 slots: the pool fills and evicts
        now[0] += 1.0
        doc = tuple(rng.randrange(10, 1000) for _ in range(4))
        cp.complete(cp.gen_plans([Batch((BatchRequest(f"w{i}", doc),))], [1]))  # no tail
        cp.finish_request(f"w{i}")
        docs.append(doc)
    tree = cp.get_prefix_tree()
    hot = next(d for d in reversed(docs) if tree.match(d).keys)
    (key,) = tree.match(hot).keys
    (src,) = tree.replicas(key)
    assert cp.pool.slots.free_count(1 - src.instance) == 0  # the target is full
    cp.record_reads([((key,), {src.instance: 1})], iterations=50)
    before = cp.pool.stats().evictions
    started = cp.rebalance()
    assert [(r.key, r.target.instance) for r in started] == [(key, 1 - src.instance)]
    assert cp.pool.stats().evictions == before + 1  # a colder replica made room
    cp.finish_replication(started[0])
    assert {loc.instance for loc in tree.replicas(key)} == {0, 1}
    cp.check()


# ------------------------------------------------ the radix tree the benchmark compares


@settings(max_examples=80, deadline=None)
@given(stored=st.lists(SEQ, min_size=1, max_size=8), query=SEQ)
def test_the_benchmark_radix_tree_matches_the_longest_stored_prefix(stored, query):
    from tokenlake.tools.bench.match import RadixStandIn

    radix = RadixStandIn()
    seen: list = []
    for s in stored:
        cached = radix.insert(list(s))
        assert cached == max((common_prefix(s, t) for t in seen), default=0)
        seen.append(s)
    values = radix.match_prefix(list(query))
    assert len(values) == max(common_prefix(query, s) for s in stored)
    assert len(set(values)) == len(values)  # one slot per cached token


def test_a_prompt_with_an_id_past_65535_matches_up_to_it_on_a_narrow_tree():
    """The tree keeps 2-byte tokens while every id fits: a prompt holding a larger id
    matches up to that id (which no stored segment can hold), never past it, and a
    partial last segment is never taken for a whole one."""
    cp = _control(page=2)
    _store(cp, "a", tuple(range(10, 10 + 3 * C)))
    tree = cp.get_prefix_tree()
    prompt = tuple(range(10, 10 + C + 6)) + (70_000,) + tuple(range(10 + C + 7, 10 + 3 * C))
    assert tree.match(prompt).hit_tokens == C + 6
    assert tree.match(tuple(range(10, 10 + C // 2)) + (70_000,) * C).hit_tokens == C // 2
    _store(cp, "t", (0, 0, 0, 0))  # a tail node of half a segment
    assert tree.match((0, 0, 0, 0, 70_000, 0, 0, 0)).hit_tokens == 4
    _store(cp, "w", (5, 70_000) * C)  # the tree widens; what it held still matches
    assert tree.match(prompt).hit_tokens == C + 6
    assert tree.match((5, 70_000) * C + (1,)).hit_tokens == 2 * C

"""Tests of the control plane (tokenlake/core/control.py, docs/design.md §3-§5).

The central property test replays random iterations against a small shadow model of
what the pool must hold (every request's token sequence and its open tail) and checks
every plan row by row: each new token is stored exactly once at its position in its
segment (or deduplicated), and each request's query reads exactly its pool prefix.
"""

from __future__ import annotations

import random

import pytest
from dataplane_util import ManualClock
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenlake.core.config import PoolConfig
from tokenlake.core.control import ControlPlane
from tokenlake.core.errors import CapacityError, PlanError, PrefixNotCached
from tokenlake.core.plans import Batch, BatchRequest, Plans
from tokenlake.core.specs import load_model

MODEL = load_model("smollm2-135m")
INSTANCES = (0, 1, 2, 3)


# ---------------------------------------------------------------- helpers


def make_cp(c=4, slots=64, instances=INSTANCES, clock=None, **kw) -> ControlPlane:
    cfg = PoolConfig(segment_tokens=c, namespace="test-model", slots_per_instance=slots, **kw)
    return ControlPlane(cfg, MODEL, list(instances), clock=clock or ManualClock())


def req(rid, tokens, prefix=()) -> BatchRequest:
    return BatchRequest(rid, tuple(tokens), tuple(prefix))


def batch(*reqs, phase="prefill") -> Batch:
    return Batch(tuple(reqs), phase)


def run(cp, batches, dops=None) -> Plans:
    """Plans one iteration and reports it stored."""
    plans = cp.gen_plans(batches, dops or [1] * len(batches))
    cp.complete(plans)
    return plans


def keys_of(cp, tokens):
    return cp.pool.hasher.keys(list(tokens))


def tree_state(cp) -> dict:
    """Everything the tree knows, comparable with ``==``."""
    tree = cp.get_prefix_tree()
    return {
        k: (
            tree.parent(k),
            tree.index(k),
            tree.replicas(k, ready_only=False),
            tree.replicas(k),
            tree.lease_count(k),
            tree.is_pinned(k),
            tuple(tree.last_access(k, loc.instance) for loc in tree.replicas(k, False)),
        )
        for k in tree.keys()
    }


def request_table(cp) -> dict:
    """The control plane's request table (white box: chain, open tail, busy flag)."""
    return {
        s.request_id: (list(s.chain), s.tail, list(s.tail_tokens), s.busy)
        for s in cp.requests.states()
    }


def full_state(cp) -> tuple:
    stats = cp.stats()
    return (
        tree_state(cp),
        request_table(cp),
        stats,
        cp.get_prefix_tree().evictable_count(),
    )


def split(total, dop):
    base, extra = divmod(total, dop)
    out, start = [], 0
    for i in range(dop):
        stop = start + base + (i < extra)
        out.append((start, stop))
        start = stop
    return out


def reads_of(qp, rid, start):
    """(instance, slot, tokens) read by the rows of ``rid`` starting at ``start``
    (sealed segments in ``tasks`` and the open tail in ``tails``)."""
    out = []
    for task in qp.tasks + qp.tails:
        for it in task.items:
            if it.request_id == rid and it.start == start:
                out.extend(zip([task.instance] * len(it.slots), it.slots, it.tokens))
    return out


# ------------------------------------------------------------ shadow model


class Shadow:
    """What the pool must hold for every live request: its tokens and open-tail slot."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.c = cp.config.segment_tokens
        self.tokens: dict[str, list[int]] = {}
        self.tail: dict[str, tuple[int, int] | None] = {}

    def check_plans(self, plans: Plans, batches, dops) -> dict:
        """Checks ``plans`` row by row; returns the shadow update to apply on complete."""
        cp, c = self.cp, self.c
        tree = cp.get_prefix_tree()
        # Expected fate of every new token, request by request in planning order.
        before: dict[str, int] = {}
        seqs: dict[str, list[int]] = {}
        fate: dict[tuple[str, int], tuple] = {}
        dedup = 0
        for b in batches:
            for r in b.requests:
                rid = r.request_id
                old = self.tokens.get(rid, list(r.prefix_token_ids))
                seq = old + list(r.new_token_ids)
                before[rid], seqs[rid] = len(old), seq
                keys = keys_of(cp, seq)
                known = self._known_for[rid]
                dedup += sum(k in known for k in keys[len(old) // c :])
                for j in range(len(r.new_token_ids)):
                    s = (len(old) + j) // c
                    if (s + 1) * c > len(seq):
                        fate[rid, j] = ("tail",)
                    elif keys[s] in known:
                        fate[rid, j] = ("dedup",)
                    else:
                        fate[rid, j] = ("store", keys[s])
        # Groups and homes.
        assert len(plans.groups) == len(batches)
        homes = [h for g in plans.groups for h in g]
        assert len(homes) == len(set(homes)) == sum(dops)
        assert set(homes) <= set(cp.pool.instances)
        assert [len(g) for g in plans.groups] == list(dops)
        qps, tps, groups = plans
        assert len(qps) == len(tps) == sum(dops)
        new_tail: dict[str, tuple[int, int]] = {}
        covered_offsets: dict[bytes, set[int]] = {}
        written: set[tuple[int, int, int]] = set()
        n_plan = 0
        for bi, (b, dop) in enumerate(zip(batches, dops)):
            flat = [(r.request_id, j) for r in b.requests for j in range(len(r.new_token_ids))]
            for p, (lo, hi) in enumerate(split(len(flat), dop)):
                qp, tp = qps[n_plan], tps[n_plan]
                n_plan += 1
                assert (qp.batch, qp.part, tp.batch, tp.part) == (bi, p, bi, p)
                assert qp.home == tp.home == groups[bi][p]
                assert qp.num_rows == tp.num_rows == hi - lo
                # Spans: rows 0..num_rows-1 exactly once, in batch order.
                row = 0
                for span in qp.spans:
                    assert span.start == row < span.stop
                    rid, j0 = flat[lo + row]
                    assert span.request_id == rid
                    assert span.prefix_tokens == before[rid]
                    assert span.position == before[rid] + j0
                    for k in range(span.start, span.stop):
                        assert flat[lo + k] == (rid, j0 + k - span.start)
                    row = span.stop
                assert row == qp.num_rows
                # Puts: every row at most once, at its offset; dedup rows counted.
                put_rows: set[int] = set()
                for put in tp.puts:
                    assert 0 <= put.start < put.stop <= tp.num_rows
                    assert 0 <= put.offset and put.offset + put.stop - put.start <= c
                    for k in range(put.start, put.stop):
                        assert k not in put_rows
                        put_rows.add(k)
                        rid, j = flat[lo + k]
                        pos = before[rid] + j
                        assert put.offset + k - put.start == pos % c
                        cell = (put.instance, put.slot, pos % c)
                        assert cell not in written, "two rows written to one slot cell"
                        written.add(cell)
                        expected = fate[rid, j]
                        started_in_tail = pos // c * c < before[rid]
                        if put.key is None:
                            assert expected == ("tail",)
                            loc = (put.instance, put.slot)
                            if started_in_tail:
                                assert loc == self.tail[rid]
                            assert new_tail.setdefault(rid, loc) == loc
                        else:
                            assert expected == ("store", put.key)
                            covered_offsets.setdefault(put.key, set()).add(pos % c)
                            locs = tree.replicas(put.key, ready_only=False)
                            assert len(locs) == 1
                            assert (locs[0].instance, locs[0].slot) == (put.instance, put.slot)
                            assert not tree.is_ready(put.key)
                            if started_in_tail:  # the open tail was sealed in place
                                assert (put.instance, put.slot) == self.tail[rid]
                dedup_rows = [k for k in range(tp.num_rows) if k not in put_rows]
                for k in dedup_rows:
                    assert fate[flat[lo + k]] == ("dedup",)
                assert tp.dedup_rows == len(dedup_rows)
                assert sum(pt.stop - pt.start for pt in tp.puts) + tp.dedup_rows == tp.num_rows
                # Query: each span reads exactly its request's pool prefix.
                span_rows = {(s.request_id, s.start, s.stop) for s in qp.spans}
                for tasks in (qp.tasks, qp.tails):
                    assert len({t.instance for t in tasks}) == len(tasks)
                    for task in tasks:
                        assert task.items
                        for it in task.items:
                            assert (it.request_id, it.start, it.stop) in span_rows
                            assert len(it.slots) == len(it.tokens) > 0
                for it in (it for t in qp.tails for it in t.items):
                    assert len(it.slots) == 1 and 0 < it.tokens[0] < c
                for it in (it for t in qp.tasks for it in t.items):
                    assert set(it.tokens) == {c}
                for span in qp.spans:
                    self._check_reads(qp, span, seqs[span.request_id])
        # A sealed segment's rows fill it up to C (earlier rows sat in the open tail).
        for offs in covered_offsets.values():
            assert max(offs) == c - 1
            assert offs == set(range(min(offs), c))
        assert cp.stats().pool.dedup_segments - self.dedup_before == dedup
        return {"seqs": seqs, "new_tail": new_tail, "dedup": dedup}

    def prepare(self, batches) -> None:
        """What the tree holds before gen_plans: each request dedups against the keys
        that existed before it was placed (earlier requests of the iteration included)."""
        tree = self.cp.get_prefix_tree()
        self.dedup_before = self.cp.stats().pool.dedup_segments
        known = set(tree.keys())
        self._known_for = {}
        for b in batches:
            for r in b.requests:
                self._known_for[r.request_id] = set(known)
                seq = self.tokens.get(r.request_id, list(r.prefix_token_ids)) + list(
                    r.new_token_ids
                )
                known.update(keys_of(self.cp, seq))

    def _check_reads(self, qp, span, seq) -> None:
        cp, c = self.cp, self.c
        tree = cp.get_prefix_tree()
        n = span.prefix_tokens
        got = reads_of(qp, span.request_id, span.start)
        if n == 0:
            assert got == []
            return
        assert sum(t for _, _, t in got) == n
        chain = keys_of(cp, seq[: n // c * c])
        remaining = list(got)
        for key in chain:
            locs = {(loc.instance, loc.slot) for loc in tree.replicas(key)}
            hits = [g for g in remaining if (g[0], g[1]) in locs and g[2] == c]
            assert len(hits) == 1, "each sealed segment is read from exactly one replica"
            remaining.remove(hits[0])
        if n % c:
            assert remaining == [(*self.tail[span.request_id], n % c)]
        else:
            assert remaining == []

    def apply(self, update) -> None:
        """The plans completed: the pool now holds the new tokens."""
        c = self.c
        for rid, seq in update["seqs"].items():
            self.tokens[rid] = seq
            if len(seq) % c == 0:
                self.tail[rid] = None
            elif rid in update["new_tail"]:
                self.tail[rid] = update["new_tail"][rid]

    def finish(self, rid) -> None:
        del self.tokens[rid]
        del self.tail[rid]

    def check_pool(self) -> None:
        cp, c = self.cp, self.c
        tree = cp.get_prefix_tree()
        check_invariants(cp)
        assert set(cp.live_requests) == set(self.tokens)
        for rid, seq in self.tokens.items():
            assert cp.prefix_tokens(rid) == len(seq)
            full = len(seq) // c * c
            assert tree.match(seq).hit_tokens == full
            for key in keys_of(cp, seq):
                assert tree.lease_count(key) >= 1  # a live request's chain is leased
        tails = [t for t in self.tail.values() if t is not None]
        assert cp.stats().pool.private_slots == len(tails) == len(set(tails))


# --------------------------------------------------- property: coverage


def _bases(c):
    return [tuple(1 + 1000 * k + p for p in range(400)) for k in range(3)]


@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), c=st.sampled_from([1, 3, 4]))
def test_random_iterations_cover_every_row_and_read_every_prefix(data, c):
    cp = make_cp(c=c, slots=400)
    shadow = Shadow(cp)
    bases = _bases(c)
    sequences: dict[str, tuple[int, ...]] = {}
    counter = 0
    count_st = st.one_of(
        st.sampled_from(sorted({max(1, c - 1), c, 2 * c, 3 * c, c + 1, 1})),
        st.integers(1, 3 * c + 2),
    )
    for _ in range(data.draw(st.integers(1, 5), label="iterations")):
        nb = data.draw(st.integers(1, 3), label="batches")
        dops = []
        for i in range(nb):
            room = len(INSTANCES) - sum(dops) - (nb - i - 1)
            dops.append(data.draw(st.integers(1, min(3, room)), label="dop"))
        live = [r for r in sorted(shadow.tokens)]
        batches = []
        for _b in range(nb):
            reqs = []
            for _r in range(data.draw(st.integers(1, 3), label="requests")):
                n = data.draw(count_st, label="new tokens")
                if live and data.draw(st.booleans(), label="continue live"):
                    rid = live.pop(data.draw(st.integers(0, len(live) - 1)))
                    have = len(shadow.tokens[rid])
                    reqs.append(req(rid, sequences[rid][have : have + n]))
                    continue
                rid = f"r{counter}"
                counter += 1
                base = bases[data.draw(st.integers(0, 2), label="base")]
                diverge = data.draw(st.sampled_from([0, 2, c, 2 * c + 1, 400]), label="diverge")
                rnd = random.Random(counter)
                sequences[rid] = base[:diverge] + tuple(
                    rnd.randrange(10_000, 20_000) for _ in range(400 - diverge)
                )
                prefix = ()
                if data.draw(st.booleans(), label="use prefix"):
                    hit = cp.get_prefix_tree().match(sequences[rid]).hit_tokens
                    prefix = sequences[rid][:hit]
                reqs.append(req(rid, sequences[rid][len(prefix) : len(prefix) + n], prefix))
            batches.append(batch(*reqs, phase=data.draw(st.sampled_from(["prefill", "decode"]))))
        before = full_state(cp)
        shadow.prepare(batches)
        plans = cp.gen_plans(batches, dops)
        update = shadow.check_plans(plans, batches, dops)
        if data.draw(st.integers(0, 4), label="abort") == 0:
            cp.abort(plans)
            after = full_state(cp)
            assert after[:2] == before[:2]
            assert after[3] == before[3]
            assert _stats_wo_reads(after[2]) == _stats_wo_reads(before[2])
        else:
            cp.complete(plans)
            shadow.apply(update)
        shadow.check_pool()
        for rid in sorted(shadow.tokens):
            if data.draw(st.integers(0, 3), label="finish") == 0:
                cp.finish_request(rid)
                shadow.finish(rid)
        shadow.check_pool()


def _stats_wo_reads(stats):
    pool = stats.pool
    return (
        stats.admitted_requests,
        stats.hit_tokens,
        stats.prefill_tokens,
        stats.dedup_bytes,
        pool.segments,
        pool.replicas,
        pool.pinned,
        dict(pool.slots_used),
        pool.private_slots,
        pool.dedup_segments,
        pool.evictions,
    )


# ------------------------------------------------------------ query plans


def test_request_without_prefix_is_in_no_task_and_spans_number_rows():
    cp = make_cp()
    run(cp, [batch(req("old", range(1, 11)))])  # 2 segments + 2-token tail
    plans = cp.gen_plans([batch(req("old", [11, 12, 13]), req("new", range(100, 105)))], [1])
    (qp,), (tp,), groups = plans
    assert [(s.request_id, s.start, s.stop, s.position, s.prefix_tokens) for s in qp.spans] == [
        ("old", 0, 3, 10, 10),
        ("new", 3, 8, 0, 0),
    ]
    assert all(it.request_id == "old" for t in qp.tasks for it in t.items)
    reads = reads_of(qp, "old", 0)
    assert sorted(t for _, _, t in reads) == [2, 4, 4]
    assert sum(t for _, _, t in reads) == 10
    assert groups == ((qp.home,),)
    cp.complete(plans)


def test_groups_distinct_and_plans_unpack():
    cp = make_cp(instances=(10, 20, 30, 40, 50))
    batches = [
        batch(req("a", range(1, 30))),
        batch(req("b", range(100, 103)), req("c", range(200, 209))),
        batch(req("d", [7])),
    ]
    plans = cp.gen_plans(batches, [2, 2, 1])
    query_plans, transfer_plans, groups = plans
    assert query_plans is plans.query_plans and transfer_plans is plans.transfer_plans
    assert [len(g) for g in groups] == [2, 2, 1]
    homes = [h for g in groups for h in g]
    assert len(set(homes)) == 5 and set(homes) <= {10, 20, 30, 40, 50}
    assert [(q.batch, q.part) for q in query_plans] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert [q.num_rows for q in query_plans] == [15, 14, 6, 6, 1]
    # Batch 1 (12 rows) splits inside request c: c's rows continue in part 1.
    assert [(s.request_id, s.start, s.stop, s.position) for s in query_plans[3].spans] == [
        ("c", 0, 6, 3)
    ]
    cp.complete(plans)


# ---------------------------------------------------------- decode growth


def test_decode_grows_prefix_and_seals_tail_on_complete():
    cp = make_cp(c=4)
    tree = cp.get_prefix_tree()
    prompt = list(range(1, 11))
    run(cp, [batch(req("a", prompt))])
    seq = list(prompt)
    tail_loc = None
    for step in range(10):
        tok = 500 + step
        plans = cp.gen_plans([batch(req("a", [tok]), phase="decode")], [1])
        (qp,), (tp,), _ = plans
        (span,) = qp.spans
        assert span.prefix_tokens == span.position == 10 + step
        assert sum(t for _, _, t in reads_of(qp, "a", 0)) == 10 + step
        (put,) = tp.puts
        assert put.offset == (10 + step) % 4 and put.stop - put.start == 1
        seq.append(tok)
        sealing = len(seq) % 4 == 0
        if tail_loc is not None:
            assert (put.instance, put.slot) == tail_loc  # the open tail stays in place
        if sealing:
            key = keys_of(cp, seq)[-1]
            assert put.key == key
            assert key in tree and not tree.is_ready(key)
            assert tree.match(seq).hit_tokens == len(seq) - 4  # not visible yet
        else:
            assert put.key is None
        cp.complete(plans)
        assert cp.prefix_tokens("a") == len(seq)
        assert tree.match(seq).hit_tokens == len(seq) // 4 * 4
        if sealing:
            assert tree.is_ready(put.key)
            tail_loc = None
        else:
            tail_loc = (put.instance, put.slot)
    assert [s for s in range(10) if (11 + s) % 4 == 0] == [1, 5, 9]
    assert len(tree) == 5
    tree.check()


# ------------------------------------------------------------------ dedup


def test_same_prompt_twice_in_one_iteration_is_stored_once():
    cp = make_cp(c=4)
    prompt = tuple(range(1, 13))
    plans = cp.gen_plans([batch(req("a", prompt), req("b", prompt))], [1])
    (qp,), (tp,), _ = plans
    assert tp.num_rows == 24
    assert [(p.start, p.stop) for p in tp.puts] == [(0, 4), (4, 8), (8, 12)]
    assert tp.dedup_rows == 12
    stats = cp.stats()
    assert stats.pool.dedup_segments == 3
    assert stats.dedup_bytes == 3 * MODEL.segment_bytes(4)
    assert stats.pool.segments == 3
    # b's chain is a's chain: nothing becomes visible before complete.
    assert cp.get_prefix_tree().match(prompt).hit_tokens == 0
    cp.complete(plans)
    assert cp.get_prefix_tree().match(prompt).hit_tokens == 12
    for key in keys_of(cp, prompt):
        assert cp.get_prefix_tree().lease_count(key) == 2
    # A third request reuses the first two segments through prefix_token_ids.
    plans = run(cp, [batch(req("c", prompt[8:] + (99,), prefix=prompt[:8]))])
    (qp,), (tp,), _ = plans
    assert qp.spans[0].prefix_tokens == 8
    assert tp.dedup_rows == 4  # its tokens 8..11 complete a cached segment
    stats = cp.stats()
    assert stats.hit_tokens == 8 and stats.admitted_requests == 3
    assert stats.prefill_tokens == 24 + 5
    assert stats.hit_rate == pytest.approx(8 / (8 + 29))
    assert stats.pool.dedup_segments == 4
    assert cp.prefix_tokens("c") == 13


def test_open_tail_that_fills_into_a_cached_segment_is_released():
    cp = make_cp(c=4)
    run(cp, [batch(req("a", range(1, 9)))])  # stores 2 full segments
    run(cp, [batch(req("b", range(1, 7)))])  # 1 deduped segment + 2-token tail
    assert cp.stats().pool.private_slots == 1
    plans = cp.gen_plans([batch(req("b", [7, 8, 9]), phase="decode")], [1])
    (tp,) = plans.transfer_plans
    assert tp.dedup_rows == 2 and len(tp.puts) == 1 and tp.puts[0].key is None
    assert cp.stats().pool.private_slots == 2  # old tail kept until complete, new tail
    cp.complete(plans)
    assert cp.stats().pool.private_slots == 1
    assert cp.prefix_tokens("b") == 9
    cp.get_prefix_tree().check()


# -------------------------------------------------------- validation errors


def test_prefix_validation():
    cp = make_cp(c=4)
    prompt = tuple(range(1, 13))
    run(cp, [batch(req("a", prompt))])
    with pytest.raises(PrefixNotCached):
        cp.gen_plans([batch(req("x", [1], prefix=prompt[:6]))], [1])  # not whole segments
    with pytest.raises(PrefixNotCached):
        cp.gen_plans([batch(req("x", [1], prefix=(5, 5, 5, 5)))], [1])  # not cached
    with pytest.raises(PrefixNotCached):
        cp.gen_plans([batch(req("x", [1], prefix=prompt + (13, 14, 15, 16)))], [1])
    with pytest.raises(PlanError):
        cp.gen_plans([batch(req("a", [1], prefix=prompt[:4]))], [1])  # live request
    assert "x" not in cp.live_requests
    # A prefix still being stored (in flight) is not cached yet.
    plans = cp.gen_plans([batch(req("b", range(50, 58)))], [1])
    with pytest.raises(PrefixNotCached):
        cp.gen_plans([batch(req("y", [1], prefix=tuple(range(50, 54))))], [1])
    cp.complete(plans)
    run(cp, [batch(req("y", [1], prefix=tuple(range(50, 54))))])
    assert cp.stats().hit_tokens == 4


@pytest.mark.parametrize(
    "batches, dops",
    [
        ([batch(req("a", [1]), req("a", [2]))], [1]),
        ([batch(req("a", [1])), batch(req("a", [2]))], [1, 1]),
        ([batch()], [1]),
        ([batch(req("a", []))], [1]),
        ([batch(req("a", [1]))], []),
        ([batch(req("a", [1]))], [1, 1]),
        ([batch(req("a", [1])), batch(req("b", [1]))], [3, 2]),
        ([batch(req("a", [1] * 10))], [5]),
        ([batch(req("a", [1]))], [0]),
        ([batch(req("a", [1]))], [-1]),
        ([Batch((req("a", [1]),), phase="both")], [1]),
    ],
)
def test_malformed_batches_raise_plan_error(batches, dops):
    cp = make_cp()
    before = full_state(cp)
    with pytest.raises(PlanError):
        cp.gen_plans(batches, dops)
    assert full_state(cp) == before
    run(cp, [batch(req("ok", [1, 2, 3]))])


def test_request_in_flight_cannot_be_planned_again():
    cp = make_cp()
    p1 = cp.gen_plans([batch(req("a", range(1, 7)))], [1])
    with pytest.raises(PlanError):
        cp.gen_plans([batch(req("a", [7]))], [1])
    with pytest.raises(PlanError):
        cp.finish_request("a")
    p2 = cp.gen_plans([batch(req("b", [1, 2]))], [1])  # others may be planned meanwhile
    cp.complete(p1)
    p3 = cp.gen_plans([batch(req("a", [7]), phase="decode")], [1])
    with pytest.raises(PlanError):
        cp.gen_plans([batch(req("a", [8]))], [1])
    cp.abort(p3)
    run(cp, [batch(req("a", [7]), phase="decode")])
    cp.complete(p2)
    assert cp.prefix_tokens("a") == 7 and cp.prefix_tokens("b") == 2


# --------------------------------------------------------------- atomicity


def test_capacity_error_midway_leaves_everything_as_before():
    cp = make_cp(c=4, slots=2, instances=(0, 1, 2))  # 6 slots in all
    run(cp, [batch(req("a", range(1, 11)))])  # 2 leased segments + private tail: 3 slots
    run(cp, [batch(req("h", range(1, 5)), phase="decode")])  # dedups a's first segment
    before = full_state(cp)
    keys_before = set(cp.get_prefix_tree().keys())
    big = [
        batch(
            req("a", [11, 12, 13]),  # seals a's tail in place, opens a new tail
            req("p", [3], prefix=tuple(range(1, 9))),  # admitted with a hit
            req("h", [5]),
            req("z", range(100, 120)),  # 5 new segments: cannot fit
        )
    ]
    with pytest.raises(CapacityError):
        cp.gen_plans(big, [1])
    assert full_state(cp) == before
    assert set(cp.get_prefix_tree().keys()) == keys_before
    assert set(cp.live_requests) == {"a", "h"}
    cp.get_prefix_tree().check()
    # A smaller batch still works, and reuses a's open tail in place.
    plans = run(cp, [batch(req("a", [11, 12]), req("z", range(100, 104)))])
    (tp,) = plans.transfer_plans
    assert cp.prefix_tokens("a") == 12 and cp.prefix_tokens("z") == 4
    assert tp.puts[0].key == keys_of(cp, range(1, 13))[-1]
    assert cp.stats().admitted_requests == 3


def test_capacity_error_does_not_evict():
    """Evicting cold segments for a plan that then fails would lose them for nothing."""
    cp = make_cp(c=4, slots=2, instances=(0, 1, 2))
    run(cp, [batch(req("cold", range(1, 9)))])
    cp.finish_request("cold")  # 2 evictable segments, 4 free slots
    before = full_state(cp)
    with pytest.raises(CapacityError):
        cp.gen_plans([batch(req("z", range(100, 128)))], [1])  # 7 segments
    assert full_state(cp) == before
    assert cp.get_prefix_tree().match(range(1, 9)).hit_tokens == 8
    run(cp, [batch(req("z", range(100, 124)))])  # 6 segments: evicts both cold ones
    assert cp.stats().pool.evictions == 2
    assert cp.get_prefix_tree().match(range(1, 9)).hit_tokens == 0


def test_placement_does_not_evict_a_later_requests_declared_prefix():
    """One call admits every request before placing any: the first request's new
    segments evict other segments, never the prefix the second request declares."""
    clock = ManualClock()
    cp = make_cp(c=4, slots=4, instances=(0,), clock=clock)
    for t, (rid, toks) in enumerate([("p", range(1, 5)), ("q", range(50, 54)),
                                     ("r", range(60, 64))]):
        clock.now = float(t)  # LRU order: P, Q, R
        run(cp, [batch(req(rid, toks))])
        cp.finish_request(rid)
    clock.now = 5.0
    # 1 free slot; "x" needs 2 and "y" 1, so two segments go. "y" declares P its prefix.
    plans = run(cp, [batch(req("x", range(100, 108)), req("y", range(5, 9), range(1, 5)))])
    tree = cp.get_prefix_tree()
    assert cp.prefix_tokens("y") == 8
    assert tree.match(range(1, 9)).hit_tokens == 8  # P kept (leased by y), y's segment after it
    assert tree.match(range(50, 54)).hit_tokens == 0
    assert tree.match(range(60, 64)).hit_tokens == 0
    assert cp.stats().pool.evictions == 2
    reads = [it for qp in plans.query_plans for t in qp.tasks for it in t.items
             if it.request_id == "y"]
    assert sum(sum(it.tokens) for it in reads) == 4


# ----------------------------------------------------- abort and complete


def test_abort_undoes_new_segments_and_tail():
    cp = make_cp(c=4)
    tree = cp.get_prefix_tree()
    run(cp, [batch(req("a", range(1, 11)))])
    before = full_state(cp)
    plans = cp.gen_plans([batch(req("a", range(11, 17)), req("n", range(1, 6)))], [2])
    assert len(tree) > len(before[0])
    assert cp.prefix_tokens("a") == 16
    cp.abort(plans)
    assert full_state(cp)[:2] == before[:2]
    assert _stats_wo_reads(cp.stats()) == _stats_wo_reads(before[2])
    assert cp.prefix_tokens("a") == 10
    assert "n" not in cp.live_requests
    with pytest.raises(PlanError):
        cp.abort(plans)
    with pytest.raises(PlanError):
        cp.complete(plans)
    # The same step can be planned again and keeps using a's original tail slot.
    tail = before[1]["a"][1]
    plans = run(cp, [batch(req("a", range(11, 17)))])
    seal = plans.transfer_plans[0].puts[0]
    assert (seal.instance, seal.slot, seal.offset) == (tail.instance, tail.slot, 2)
    tree.check()


def test_complete_twice_or_unknown_iteration():
    cp = make_cp()
    plans = run(cp, [batch(req("a", [1, 2, 3]))])
    with pytest.raises(PlanError):
        cp.complete(plans)
    with pytest.raises(PlanError):
        cp.complete(Plans(99, (), (), ()))
    with pytest.raises(PlanError):
        cp.abort(Plans(99, (), (), ()))


# ---------------------------------------------------------- finish_request


def test_finish_request_releases_leases_and_tail():
    cp = make_cp(c=4)
    tree = cp.get_prefix_tree()
    run(cp, [batch(req("a", range(1, 11)))])
    run(cp, [batch(req("b", range(1, 9)))])  # shares both of a's segments
    s0 = cp.stats().pool
    assert tree.evictable_count() == 0
    cp.finish_request("a")
    s1 = cp.stats().pool
    assert tree.evictable_count() == 0  # b still leases them
    assert s1.private_slots == s0.private_slots - 1
    assert sum(s1.slots_used.values()) == sum(s0.slots_used.values()) - 1
    cp.finish_request("b")
    assert tree.evictable_count() == 1  # the leaf; its parent has a child
    assert all(tree.lease_count(k) == 0 for k in tree.keys())
    assert cp.stats().pool.private_slots == 0
    assert cp.live_requests == ()
    with pytest.raises(PlanError):
        cp.finish_request("a")
    tree.check()


# ---------------------------------------------------------------- dispatch


def _prefill_until_colocated(cp, rid_prefix, avoid=()):
    """Prefills requests until one has its whole prefix (3 segments + tail) mostly on one
    instance and its tail there too; returns (rid, instance)."""
    for n in range(500):
        rid = f"{rid_prefix}{n}"
        tokens = [(n * 37 + i * 11 + len(rid_prefix)) * 13 + 1 for i in range(14)]
        plans = run(cp, [batch(req(rid, tokens))])
        (tp,) = plans.transfer_plans
        places = [p.instance for p in tp.puts]
        tail = places[-1]
        if places.count(tail) >= 3 and tail not in avoid:
            return rid, tail
        cp.finish_request(rid)
    raise AssertionError("no colocated request found")


def test_decode_batch_dispatched_where_its_prefix_lives():
    cp = make_cp(c=4, slots=600)
    ra, home_a = _prefill_until_colocated(cp, "a")
    rb, home_b = _prefill_until_colocated(cp, "b", avoid=(home_a,))
    for step in range(2):  # decode in the open tail: every byte is local at home
        batches = [
            batch(req(rb, [7 + step]), phase="decode"),
            batch(req(ra, [7 + step]), phase="decode"),
        ]
        plans = cp.gen_plans(batches, [1, 1])
        assert plans.groups[0] == (home_b,) and plans.groups[1] == (home_a,)
        for qp in plans.query_plans:
            assert {t.instance for t in qp.tasks} >= {qp.home}
        cp.complete(plans)


# ------------------------------------------------------------- failures


def test_remove_instance_reports_requests_that_lost_a_segment():
    cp = make_cp(c=4)
    tree = cp.get_prefix_tree()
    for i in range(8):
        run(cp, [batch(req(f"r{i}", [100 * i + k for k in range(1, 15)]))])
    run(cp, [batch(req("empty", [5]))])  # only an open tail
    victim = 1
    expected = set()
    for state in cp.requests.states():
        rid = state.request_id
        on_victim = [
            k for k in state.chain if {loc.instance for loc in tree.replicas(k)} == {victim}
        ]
        if on_victim or (state.tail is not None and state.tail.instance == victim):
            expected.add(rid)
    assert expected and expected != set(cp.live_requests)
    lost = cp.remove_instance(victim)
    assert set(lost) == expected
    assert victim not in cp.pool.instances
    assert all(loc.instance != victim for k in tree.keys() for loc in tree.replicas(k, False))
    tree.check()
    for rid in lost:
        with pytest.raises(PlanError, match="lost"):
            cp.gen_plans([batch(req(rid, [9]), phase="decode")], [1])
        cp.finish_request(rid)
    # Survivors keep planning (re-resolved away from the victim); lost prompts recompute.
    survivors = [r for r in cp.live_requests]
    plans = run(cp, [batch(*(req(r, [9]) for r in survivors), phase="decode")], [2])
    for qp in plans.query_plans:
        assert all(t.instance != victim for t in qp.tasks)
        assert victim not in (qp.home,)
    lost_rid = sorted(lost)[0]
    if lost_rid != "empty":
        i = int(lost_rid[1:])
        run(cp, [batch(req("again", [100 * i + k for k in range(1, 15)]))])
        assert tree.match([100 * i + k for k in range(1, 15)]).hit_tokens == 12


# ------------------------------------------------------- access accounting


def test_instance_load_counts_segment_reads():
    clock = ManualClock()
    cp = make_cp(c=4, clock=clock)
    tree = cp.get_prefix_tree()
    run(cp, [batch(req("a", range(1, 11)), req("b", range(50, 63)))])
    assert sum(cp.pool.instance_load().values()) == 0  # prefill had no prefix
    expected: dict[int, int] = {}
    for step in range(5):
        clock.now += 0.5
        plans = cp.gen_plans(
            [batch(req("a", [100 + step]), req("b", [200 + step]), phase="decode")], [1]
        )
        (qp,) = plans.query_plans
        for span in qp.spans:
            for inst, _slot, toks in reads_of(qp, span.request_id, span.start):
                if toks == 4:  # a sealed segment (the open tail is not counted)
                    expected[inst] = expected.get(inst, 0) + 1
        cp.complete(plans)
    load = cp.pool.instance_load()
    reads = sum((10 + s) // 4 for s in range(5))
    reads += sum((13 + s) // 4 for s in range(5))
    assert sum(load.values()) == reads == sum(expected.values())
    assert {i: n for i, n in load.items() if n} == expected
    assert len(tree) >= 5


# ------------------------------------------- pipelined plans and failures


def check_invariants(cp) -> None:
    """Pool-wide invariants that hold after every operation, failures included."""
    cp.check()  # pool (tree, slots, copies), request table, transactions in flight
    tree = cp.get_prefix_tree()
    stats = cp.stats().pool
    assert sum(stats.slots_used.values()) == stats.replicas + stats.private_slots
    leases: dict[bytes, int] = {}
    for s in cp.requests.states():
        for k in s.chain:
            if k in tree:
                leases[k] = leases.get(k, 0) + 1
    for k in tree.keys():
        assert tree.lease_count(k) == leases.get(k, 0)


def test_dedup_against_segment_stored_by_other_plans_in_flight_is_refused():
    cp = make_cp(c=4)
    p1 = cp.gen_plans([batch(req("a", range(1, 9)))], [1])
    before = full_state(cp)
    with pytest.raises(PlanError, match="in flight"):
        cp.gen_plans([batch(req("b", range(1, 11)))], [1])
    assert full_state(cp) == before
    cp.abort(p1)  # nothing else depends on a's segments: a clean abort
    assert len(cp.get_prefix_tree()) == 0 and cp.live_requests == ()
    check_invariants(cp)
    p1 = cp.gen_plans([batch(req("a", range(1, 9)))], [1])
    cp.complete(p1)
    plans = run(cp, [batch(req("b", range(1, 11)))])
    assert plans.transfer_plans[0].dedup_rows == 8
    check_invariants(cp)


@pytest.mark.parametrize("victim", [0, 1, 2, 3])
@pytest.mark.parametrize("outcome", ["abort", "complete"])
def test_remove_instance_with_plans_in_flight(victim, outcome):
    cp = make_cp(c=4)
    run(cp, [batch(req("x", range(1, 9)))])
    run(cp, [batch(req("a", range(1, 7)))])  # deduped segment + open tail
    plans = cp.gen_plans(
        [batch(req("a", [7, 8, 9]), req("n", range(50, 60)), req("x", [9, 10, 11, 12, 13]))],
        [1],
    )
    lost = cp.remove_instance(victim)
    if outcome == "complete" and victim in plans.read_instances():
        # a reader may have attended the victim's slots after they were zeroed or reused
        with pytest.raises(PlanError, match=f"read instance {victim}, which left the pool"):
            cp.complete(plans)
        outcome = "abort"
    getattr(cp, outcome)(plans)
    check_invariants(cp)
    for rid in lost:
        if rid in cp.live_requests:
            cp.finish_request(rid)
    check_invariants(cp)
    for rid in cp.live_requests:  # survivors keep going
        run(cp, [batch(req(rid, [77]), phase="decode")])
    for rid in list(cp.live_requests):
        cp.finish_request(rid)
    check_invariants(cp)
    run(cp, [batch(req("again", range(1, 13)))])  # lost prompts are recomputed
    assert cp.get_prefix_tree().match(range(1, 13)).hit_tokens == 12
    check_invariants(cp)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_pipelined_operations_with_failures_keep_the_pool_consistent(data):
    c = 2
    cp = make_cp(c=c, slots=data.draw(st.sampled_from([3, 6, 40]), label="slots"))
    prompts = [tuple(range(1000 * k + 1, 1000 * k + 31)) for k in range(3)]
    seqs: dict[str, tuple[int, ...]] = {}
    held: dict[str, int] = {}  # tokens the pool holds per live request (shadow)
    flights: list[tuple[Plans, dict[str, int]]] = []
    busy: set[str] = set()
    lost_all: set[str] = set()
    counter = 0
    for _ in range(data.draw(st.integers(1, 14), label="ops")):
        op = data.draw(
            st.sampled_from(["plan", "plan", "plan", "done", "done", "finish", "remove"])
        )
        if op == "plan" and len(flights) < 3:
            reqs = []
            for _r in range(data.draw(st.integers(1, 3))):
                n = data.draw(st.integers(1, 2 * c + 1))
                idle = sorted(r for r in held if r not in busy and r not in lost_all)
                if idle and data.draw(st.booleans()):
                    rid = data.draw(st.sampled_from(idle))
                    if any(r.request_id == rid for r in reqs):
                        continue
                    reqs.append(req(rid, seqs[rid][held[rid] : held[rid] + n]))
                else:
                    rid = f"n{counter}"
                    counter += 1
                    seqs[rid] = data.draw(st.sampled_from(prompts)) + (counter,) * 30
                    hit = cp.get_prefix_tree().match(seqs[rid][:20]).hit_tokens
                    prefix = seqs[rid][:hit] if data.draw(st.booleans()) else ()
                    reqs.append(req(rid, seqs[rid][len(prefix) : len(prefix) + n], prefix))
            before = full_state(cp)
            try:
                plans = cp.gen_plans([batch(*reqs)], [1])
            except (PlanError, CapacityError):
                after = full_state(cp)
                assert after[:2] == before[:2] and after[3] == before[3]
                assert _stats_wo_reads(after[2]) == _stats_wo_reads(before[2])
            else:
                grow = {}
                for r in reqs:
                    grow[r.request_id] = held.get(r.request_id, len(r.prefix_token_ids)) + len(
                        r.new_token_ids
                    )
                    held.setdefault(r.request_id, len(r.prefix_token_ids))
                busy.update(grow)
                flights.append((plans, grow))
        elif op == "done" and flights:
            plans, grow = flights.pop(data.draw(st.integers(0, len(flights) - 1)))
            busy.difference_update(grow)
            read_gone = plans.read_instances() - set(cp.pool.instances)
            if data.draw(st.booleans()) and not read_gone:
                cp.complete(plans)
                held.update(grow)
            else:
                if read_gone:  # what was read may have been reused: it cannot be committed
                    with pytest.raises(PlanError, match="left the pool"):
                        cp.complete(plans)
                cp.abort(plans)
                for rid in grow:
                    if rid not in cp.live_requests:
                        del held[rid]
        elif op == "finish":
            idle = sorted(r for r in held if r not in busy)
            if idle:
                rid = data.draw(st.sampled_from(idle))
                if rid in lost_all:  # its prefix is gone: no more plans, only finish
                    with pytest.raises(PlanError, match="lost"):
                        cp.gen_plans([batch(req(rid, [1]))], [1])
                cp.finish_request(rid)
                del held[rid]
                lost_all.discard(rid)
        elif op == "remove" and len(cp.pool.instances) > 2:
            victim = data.draw(st.sampled_from(cp.pool.instances))
            lost_all.update(cp.remove_instance(victim))
        check_invariants(cp)
        for rid, n in held.items():
            if rid not in busy and rid not in lost_all:
                assert cp.prefix_tokens(rid) == n
    for plans, _ in flights:
        cp.abort(plans)
    for rid in list(cp.live_requests):
        cp.finish_request(rid)
    check_invariants(cp)
    stats = cp.stats().pool
    assert stats.private_slots == 0 and stats.pinned == 0
    assert cp.get_prefix_tree().evictable_count() == sum(
        len(cp.get_prefix_tree().replicas(k))
        for k in cp.get_prefix_tree().keys()
        if not cp.get_prefix_tree().children(k)
    )


def test_lost_request_finished_after_its_prompt_was_recomputed():
    """Finishing a lost request must not release leases that a newer request holds on
    segments stored again after the failure."""
    lost_somewhere = 0
    for victim in INSTANCES:
        cp = make_cp(c=4)
        run(cp, [batch(req("r", range(1, 15)))])
        lost = cp.remove_instance(victim)
        lost_somewhere += "r" in lost
        run(cp, [batch(req("again", range(1, 15)))])
        check_invariants(cp)
        for rid in lost:
            cp.finish_request(rid)
        check_invariants(cp)
        holders = 1 + ("r" not in lost)
        tree = cp.get_prefix_tree()
        assert all(tree.lease_count(k) == holders for k in keys_of(cp, range(1, 13)))
        cp.finish_request("again")
        check_invariants(cp)
    assert lost_somewhere


def test_a_removed_instance_rejoins_empty_and_takes_new_segments():
    cp = make_cp(c=4)
    cp.remove_instance(1)
    assert 1 not in cp.pool.instances
    cp.add_instance(1)
    assert 1 in cp.pool.instances and cp.pool.stats().slots_used[1] == 0
    for i in range(12):
        run(cp, [batch(req(f"n{i}", [1000 * i + k for k in range(1, 13)]))])
    tree = cp.get_prefix_tree()
    assert any(loc.instance == 1 for k in tree.keys() for loc in tree.replicas(k))
    tree.check()


def test_pinned_homes_are_kept_and_dispatch_takes_the_rest():
    cp = make_cp()
    doc = list(range(100, 116))
    run(cp, [batch(req("w", doc))], [1])  # the document's segments now live somewhere
    for home in INSTANCES:  # wherever the segments are, a pinned batch runs at its home
        rid = f"p{home}"
        plans = cp.gen_plans([batch(req(rid, doc[:8] + [home]))], [1], homes=[home])
        assert {p.home for p in plans.query_plans} == {home}
        assert {p.home for p in plans.transfer_plans} == {home}
        cp.complete(plans)
    # a pinned batch and two dispatched ones: the dispatched never take the pinned home
    plans = cp.gen_plans([batch(req("x", [1, 2])), batch(req("y", [3])), batch(req("z", [4]))],
                         [1, 1, 1], homes=[None, 2, None])
    homes = {p.batch: p.home for p in plans.query_plans}
    assert homes[1] == 2 and 2 not in (homes[0], homes[2]) and homes[0] != homes[2]
    cp.complete(plans)


@pytest.mark.parametrize("homes, dops, message", [
    ([0], [1, 1], "2 batches but 1 homes"),
    ([7, None], [1, 1], "not a live instance"),
    ([1, 1], [1, 1], "two batches pinned to one home"),
    ([1, None], [2, 1], "needs DoP 1"),
])
def test_bad_homes_are_refused_and_change_nothing(homes, dops, message):
    cp = make_cp()
    with pytest.raises(PlanError, match=message):
        cp.gen_plans([batch(req("a", [1, 2])), batch(req("b", [3]))], dops, homes=homes)
    plans = cp.gen_plans([batch(req("a", [1, 2])), batch(req("b", [3]))], [1, 1])
    cp.complete(plans)

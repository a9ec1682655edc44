"""Decode batches that stay together across decisions (scheduler/keep.py): a running
decode batch keeps its instance and its members unless its SLO breaks or re-forming
costs less with the moves counted; ``decode_batches="reform"`` is the stateless DP it
replaces (the first test shows it splitting what is kept here)."""

from __future__ import annotations

import pytest

from scheduler.api import (
    BatchDecision,
    Decision,
    DecisionError,
    InstanceView,
    RequestView,
    Snapshot,
)
from scheduler.goodput import GoodputScheduler
from scheduler.keep import KeptDecode, batch_time
from tokenlake.core.cost_model import LatencyModel

LAT = LatencyModel.load("a100-80gb_llama-2-7b")


def snap(reqs, n_free=2, busy=()):
    inst = tuple(InstanceView(i, busy=i in busy) for i in range(n_free))
    return Snapshot(0.0, (), tuple(reqs), inst, 0.1, LAT)


def decode(rid, ctx, inst=None, slo=None):
    return RequestView(rid, "decode", ctx, 0, 0.0, slo, decode_instance=inst)


def members(decision) -> dict[int | None, set[str]]:
    return {b.instance: set(b.request_ids) for b in decision.batches if b.phase == "decode"}


def running_pair():
    """Two decode batches running on instances 0 and 1, mixed long and short contexts
    (the stateless DP, ordering by context, would pair them otherwise), and a request
    that has just finished its prompt; a TBT SLO with room for three per batch."""
    old = [decode("a", 2_000, 0), decode("b", 90_000, 0), decode("c", 4_000, 1),
           decode("d", 95_000, 1)]
    new = decode("e", 3_000)
    slo = 1.5 * batch_time(snap(old), [*old, new])
    return [decode(r.request_id, r.context_tokens, r.decode_instance, slo) for r in [*old, new]]


def test_running_batches_keep_their_members_and_instances_and_the_new_one_joins():
    reqs = running_pair()
    got = GoodputScheduler(decode_batches="keep").solve(snap(reqs))
    assert not got.fell_back
    kept = members(got.decision)
    assert {"a", "b"} <= kept[0] and {"c", "d"} <= kept[1]
    assert "e" in kept[0] | kept[1]  # joined a running batch: no third instance needed
    stateless = members(GoodputScheduler(decode_batches="reform").solve(snap(reqs)).decision)
    assert not any({"a", "b"} <= m or {"c", "d"} <= m for m in stateless.values()), \
        "the stateless DP keeps these batches too: the test shows nothing"


def test_a_batch_over_its_slo_sheds_its_longest_contexts_and_every_batch_meets_it():
    reqs = [decode(f"r{i}", 60_000 + 1000 * i, 0) for i in range(4)]
    s = snap(reqs)
    slo = 0.9 * batch_time(s, reqs)  # the contexts grew: the batch no longer meets it
    reqs = [decode(r.request_id, r.context_tokens, 0, slo) for r in reqs]
    kept = KeptDecode.of(snap(reqs), reqs, use_slo=True)
    assert [r.request_id for r in kept.free] == ["r3"]  # the longest leaves; the rest stay
    got = GoodputScheduler(decode_batches="keep").solve(snap(reqs))
    assert not got.fell_back and len(got.decision.batches) == 2
    assert members(got.decision)[0] == {"r0", "r1", "r2"}
    views = {r.request_id: r for r in reqs}
    for b in got.decision.batches:
        assert batch_time(s, [views[rid] for rid in b.request_ids]) <= slo


def test_a_kept_batch_is_given_up_when_the_prompt_needs_its_instance():
    """Kept apart, the two decode batches would take both instances and the waiting
    prompt none: the smaller one is given up, its member joins the other, and the prompt
    gets the instance."""
    reqs = [decode("x", 1_000, 0), decode("y", 1_200, 1),
            RequestView("p", "prefill", 0, 4_000, 0.0, None)]
    got = GoodputScheduler(decode_batches="keep").solve(snap(reqs))
    (dec,) = [b for b in got.decision.batches if b.phase == "decode"]
    (pre,) = [b for b in got.decision.batches if b.phase == "prefill"]
    assert set(dec.request_ids) == {"x", "y"} and dec.instance in (0, 1) and pre.dop == 1
    got.decision.check(snap(reqs))


def test_no_decode_history_decides_as_the_stateless_dp():
    reqs = [decode(f"r{i}", 10_000 * (i + 1)) for i in range(5)]
    keep = GoodputScheduler(decode_batches="keep").solve(snap(reqs, 3))
    reform = GoodputScheduler(decode_batches="reform").solve(snap(reqs, 3))
    assert keep.decision == reform.decision and keep.total_latency_s == reform.total_latency_s


def test_named_instances_are_checked():
    reqs = [decode("a", 1_000, 0), decode("b", 1_000, 1)]
    ok = Decision((BatchDecision(("a",), "decode", 1, (1,), instance=0),
                   BatchDecision(("b",), "decode", 1, (1,), instance=1)))
    ok.check(snap(reqs))
    with pytest.raises(DecisionError, match="each for one batch"):
        Decision((BatchDecision(("a",), "decode", 1, (1,), instance=1),
                  BatchDecision(("b",), "decode", 1, (1,), instance=1))).check(snap(reqs))
    with pytest.raises(DecisionError, match="each for one batch"):
        Decision((BatchDecision(("b",), "decode", 1, (1,), instance=1),)).check(snap(reqs, busy=(1,)))
    with pytest.raises(DecisionError, match="only a decode batch"):
        BatchDecision(("p",), "prefill", 1, (5,), instance=0)
    with pytest.raises(DecisionError, match="decode_instance outside decode"):
        RequestView("p", "prefill", 0, 5, 0.0, None, decode_instance=0)
    with pytest.raises(ValueError, match="decode_batches"):
        GoodputScheduler(decode_batches="sometimes")


def test_the_simulator_keeps_decode_batches_on_their_instances():
    """A small ShareGPT load (short chats behind one system prompt) on 8 simulated
    A100s: with decode batches kept, far fewer decode steps run on another instance than
    the step before, and no fewer requests meet their SLO than with the stateless DP."""
    from dataclasses import replace

    from evals.experiments import at_rate, build_workload
    from evals.sim.config import SimConfig
    from evals.sim.systems import simulate

    reqs = at_rate(build_workload("sharegpt", 0.1), 16.0, 0)
    keep = simulate(reqs, "tokenlake", SimConfig(instances=8))
    reform = simulate(reqs, "tokenlake", replace(SimConfig(instances=8), decode_batches="reform"))
    assert reform.extra["decode_moves"] > 0, "nothing moved: the test shows nothing"
    assert keep.extra["decode_moves"] < reform.extra["decode_moves"] / 2
    assert keep.slo_attainment >= reform.slo_attainment

"""What keeps TokenLake's simulated decodes from waiting (issue #20, docs/evaluation.md
"What sets TokenLake's knee"): a decode batch does not wait for a member whose prompt is
still computing, decode batches take the instances free now, and the simulator tells
a TBT missed waiting between batches from one missed in a slow step."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from evals.experiments import at_rate, build_workload
from evals.sim import pooled, run_timing
from evals.sim.config import SimConfig
from evals.sim.metrics import Recorder
from evals.sim.systems import simulate

#: A LooGLE-like load on 8 A100s past TokenLake's knee: prefill iterations of several
#: long prompts last longer than a decode's TBT SLO.
CONFIG = SimConfig(instances=8)


def _loogle(rate=9.0, scale=0.25):
    return at_rate(build_workload("loogle", scale), rate, 0)


def test_a_tbt_missed_waiting_is_told_from_a_slow_step():
    rec = Recorder([0], 1.0)
    waited, slow = (SimpleNamespace(tbt_sum=0.0, tbt_count=0, tbt_max=0.0, tbt_max_waited=False,
                                    last_token_s=0.0, first_token_s=0.0, arrival_s=0.0,
                                    prompt_len=10, output_len=3, hit=0) for _ in range(2))
    rec.gap(waited, 0.5, step=0.02)  # 0.48 s unscheduled, then a 20 ms step
    rec.gap(slow, 0.5, step=0.45)  # a slow step after a short wait
    assert waited.tbt_max_waited and not slow.tbt_max_waited
    sched = SimpleNamespace(durations=[0.9], end=lambda j: 1.4)
    rec.steps(sched, 1, 1, [waited])  # its longest gap is now a step inside a batch
    assert waited.tbt_max == 0.9 and not waited.tbt_max_waited
    for r in (waited, slow):
        rec.finish(r, ttft_slo_s=1.0, tbt_slo_s=0.1)
    summary = rec.summary()
    assert summary["tbt_slo_attainment"] == 0.0 and summary["tbt_miss_waited"] == 0.0
    rec2 = Recorder([0], 1.0)
    r = SimpleNamespace(tbt_sum=0.0, tbt_count=0, tbt_max=0.0, tbt_max_waited=False,
                        last_token_s=0.0, first_token_s=0.0, arrival_s=0.0,
                        prompt_len=10, output_len=2, hit=0)
    rec2.gap(r, 0.5, step=0.02)
    rec2.finish(r, ttft_slo_s=1.0, tbt_slo_s=0.1)
    assert rec2.summary()["tbt_miss_waited"] == 1.0


def test_a_decode_batch_does_not_wait_for_a_prompt_still_computing(monkeypatch):
    """Every decode run starts with members whose first token is out; the situation (a
    decision batching a request whose last prompt chunk still computes) does arise."""
    seen = {"late": 0, "runs": 0}
    wrapped = pooled.PooledBackend._without_prefilling

    def check(self, batches):
        seen["late"] += sum(1 for b in batches if b.phase == "decode" for rid in b.request_ids
                            if self.tracker[rid].first_token_s > self.now)
        out = wrapped(self, batches)
        for b in out:
            if b.phase == "decode":
                seen["runs"] += 1
                assert all(self.tracker[rid].first_token_s <= self.now for rid in b.request_ids)
        return out

    monkeypatch.setattr(pooled.PooledBackend, "_without_prefilling", check)
    res = simulate(_loogle(), "tokenlake", CONFIG)
    assert seen["late"] > 0 and seen["runs"] > 0
    assert res.requests == len(_loogle())


@pytest.mark.parametrize("decode_first", [True, False])
def test_decode_batches_take_the_instances_free_now(monkeypatch, decode_first):
    """With ``decode_first`` no decode batch is placed on an instance still finishing
    an iteration while enough instances are free; matching by bytes alone does that."""
    counts = {"checked": 0, "behind": 0}
    wrapped = run_timing.RunTiming.place

    def check(self, runs, free):
        groups = wrapped(self, runs, free)
        b = self.b
        now_free = [i for i in free if b.free_at[i] <= b.now]
        decodes = [g for run, g in zip(runs, groups) if run.phase == "decode"]
        busy = len(now_free) < len(free)
        if decodes and len(decodes) < len(runs) and busy and len(now_free) >= len(decodes):
            counts["checked"] += 1
            counts["behind"] += sum(1 for g in decodes for i in g if b.free_at[i] > b.now)
        return groups

    monkeypatch.setattr(run_timing.RunTiming, "place", check)
    simulate(_loogle(), "tokenlake", replace(CONFIG, decode_first=decode_first))
    assert counts["checked"] > 0
    if decode_first:
        assert counts["behind"] == 0
    else:
        assert counts["behind"] > 0


def test_decode_first_keeps_tbt_where_matching_by_bytes_misses_it():
    reqs = _loogle(rate=24.0, scale=0.5)
    first = simulate(reqs, "tokenlake", CONFIG)
    by_bytes = simulate(reqs, "tokenlake", replace(CONFIG, decode_first=False))
    assert by_bytes.tbt_slo_attainment < first.tbt_slo_attainment
    assert by_bytes.tbt_miss_waited > 0.5  # its misses are waits between batches

"""What keeps TokenLake's simulated decodes from waiting (issue #20, docs/evaluation.md
"What sets TokenLake's knee"): a decode batch does not wait for a member whose prompt is
still computing, decode batches take instances free when their requests are ready, and
the simulator tells a TBT missed waiting between batches from one missed in a slow step."""

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
def test_decode_batches_take_an_instance_free_when_their_requests_are(monkeypatch, decode_first):
    """With ``decode_first`` no decode batch waits for its instance whenever enough
    instances are free by the time the first decode batch's requests are ready;
    matching by bytes alone makes decode batches wait there."""
    counts = {"checked": 0, "waits": 0}
    wrapped = run_timing.RunTiming.place

    def check(self, runs, free):
        groups = wrapped(self, runs, free)
        b = self.b
        ready = [max([b.now] + [r.ready_s for r in run.reqs]) for run in runs]
        dec = [(g, t) for run, g, t in zip(runs, groups, ready) if run.phase == "decode"]
        in_time = [i for i in free if b.free_at[i] <= min((t for _, t in dec), default=b.now)]
        busy = len(in_time) < len(free)
        if dec and len(dec) < len(runs) and busy and len(in_time) >= len(dec):
            counts["checked"] += 1
            counts["waits"] += sum(1 for g, t in dec for i in g if b.free_at[i] > t)
        return groups

    monkeypatch.setattr(run_timing.RunTiming, "place", check)
    # read per row: with grouped reads decode steps here are short enough that even
    # matching by bytes rarely makes one wait, and the contrast is lost
    simulate(_loogle(), "tokenlake", replace(CONFIG, decode_first=decode_first, grouped_reads=False))
    assert counts["checked"] > 0
    if decode_first:
        assert counts["waits"] == 0
    else:
        assert counts["waits"] > 0


def test_decode_first_keeps_tbt_where_matching_by_bytes_misses_it():
    """Decode batches re-formed at every decision (placed by the dispatch each time;
    kept batches stay on their instance and need no placement, tests/test_keep_decode.py)."""
    reqs = _loogle(rate=24.0, scale=0.5)
    reform = replace(CONFIG, decode_batches="reform")
    first = simulate(reqs, "tokenlake", reform)
    by_bytes = simulate(reqs, "tokenlake", replace(reform, decode_first=False))
    assert by_bytes.tbt_slo_attainment < first.tbt_slo_attainment
    assert by_bytes.tbt_miss_waited > 0.5  # its misses are waits between batches

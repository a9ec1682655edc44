"""The instances the scheduler gives each phase, said in its decision and shown by the
simulator (``extra["instances_per_phase"]``, the timeline with ``--series``) and the
service (``tokenlake_phase_instances``, ``tokenlake_phase_instance_iterations_total``;
tests/test_http.py): the split follows the mix of waiting prompts and running decodes."""

from __future__ import annotations

import pytest

from evals.sim.phases import PhaseLog
from scheduler.api import BatchDecision, Decision, InstanceView, RequestView, Snapshot
from scheduler.goodput import GoodputScheduler
from tokenlake.core.cost_model import LatencyModel

LAT = LatencyModel.load("a100-80gb_llama-2-7b")


def _snap(reqs, n=8):
    return Snapshot(0.0, (), tuple(reqs), tuple(InstanceView(i) for i in range(n)), 0.1, LAT)


def _prefill(rid, prompt):
    return RequestView(rid, "prefill", 0, prompt, 0.0, None)


def _decode(rid, ctx, slo):
    return RequestView(rid, "decode", ctx, 0, 0.0, slo)


def test_the_decision_says_the_split_and_it_follows_the_mix():
    """Long prompts waiting beside two decodes: most instances prefill. Many long decodes
    under a tight TBT SLO beside one short prompt: several decode batches, few prefill
    instances. The split is the DoPs of the prefill batches and one per decode batch."""
    slo = 0.06
    prompts = [*(_prefill(f"p{i}", 30_000) for i in range(3)), _decode("d0", 2_000, slo),
               _decode("d1", 3_000, slo)]
    chats = [_prefill("p", 500), *(_decode(f"d{i}", 20_000 + 500 * i, slo) for i in range(40))]
    splits = []
    for reqs in (prompts, chats):
        decision = GoodputScheduler().schedule(_snap(reqs))
        split = decision.instances_per_phase
        assert split["prefill"] == sum(b.dop for b in decision.batches if b.phase == "prefill")
        assert split["decode"] == sum(b.phase == "decode" for b in decision.batches)
        assert 0 < split["prefill"] + split["decode"] <= 8
        splits.append(split)
    prompt_heavy, decode_heavy = splits
    assert prompt_heavy["prefill"] > prompt_heavy["decode"]
    assert decode_heavy["decode"] > decode_heavy["prefill"] >= 1
    assert decode_heavy["decode"] > prompt_heavy["decode"]


def test_an_empty_decision_gives_no_phase_an_instance():
    assert Decision(()).instances_per_phase == {"prefill": 0, "decode": 0}
    d = Decision((BatchDecision(("a",), "prefill", 3, (10,)), BatchDecision(("b",), "decode", 1, (1,))))
    assert d.instances_per_phase == {"prefill": 3, "decode": 1}


def test_the_phase_log_keeps_changes_and_weighs_them_by_time():
    log = PhaseLog()
    log.record(1.0, {"prefill": 6, "decode": 2})
    log.record(2.0, {"prefill": 6, "decode": 2})  # no change: no point
    log.record(3.0, {"prefill": 3, "decode": 4})
    log.record(3.0, {"prefill": 2, "decode": 5})  # decided again at once: the last one holds
    assert log.series() == [[1.0, 6, 2], [3.0, 2, 5]]
    got = log.summary(end_s=5.0, instances=8)  # 2 s at 6/2, 2 s at 2/5
    assert got["prefill"] == pytest.approx(4.0) and got["decode"] == pytest.approx(3.5)
    assert got["idle"] == pytest.approx(0.5) and got["changes"] == 1
    assert got["changes_per_s"] == pytest.approx(0.25)
    assert PhaseLog().summary(5.0, 8)["idle"] == 8.0


def test_the_simulator_reports_the_split_over_time():
    """A small ShareGPT load on 8 simulated A100s: the mean instances per phase are the
    time-weighted timeline, within the cluster, and the timeline is in the JSON only with
    ``series``."""
    from evals.experiments import at_rate, build_workload
    from evals.sim.config import SimConfig
    from evals.sim.systems import simulate

    res = simulate(at_rate(build_workload("sharegpt", 0.05), 16.0, 0), "tokenlake", SimConfig(instances=8))
    split, timeline = res.extra["instances_per_phase"], res.extra["phase_timeline"]
    assert split["prefill"] > 0 and split["decode"] > 0 and split["idle"] >= -1e-9
    assert split["changes"] == len(timeline) - 1 > 0
    assert all(0 <= p + d <= 8 for _, p, d in timeline)
    times = [t for t, _, _ in timeline]
    assert times == sorted(times)
    log = PhaseLog()
    log.points = [tuple(p) for p in timeline]
    end = timeline[0][0] + split["changes"] / split["changes_per_s"]
    assert log.summary(end, 8)["decode"] == pytest.approx(split["decode"])
    assert "phase_timeline" not in res.to_dict()["extra"]
    assert res.to_dict(series=True)["extra"]["phase_timeline"] == timeline


def _per_row_and_grouped(system: str):
    """``system`` on 8 simulated A100s, 90 chats behind the full 3,000-token system prompt
    (whole shared segments) at 32 req/s: with a read per row, then with grouped reads."""
    from dataclasses import replace

    from evals.experiments import at_rate
    from evals.sim.config import SimConfig
    from evals.sim.systems import simulate
    from evals.workloads.sharegpt import load_sharegpt

    chats = load_sharegpt(n=90, seed=0, tokenizer="whitespace", system_prompt_tokens=3000,
                          max_conversations=200).requests()
    reqs = at_rate(list(chats), 32.0, 0)
    per_row = simulate(reqs, system, replace(SimConfig(instances=8), grouped_reads=False))
    grouped = simulate(reqs, system, SimConfig(instances=8))  # the default
    assert grouped.requests == per_row.requests == 90
    return per_row, grouped


def test_grouped_reads_charge_a_shared_segment_once_per_decode_batch():
    """``grouped_reads``: the rows of a decode batch that read one segment read it once
    (the CPU engines' cascade); a second request reading the same slot adds no read, other
    slots and other instances do. On a small ShareGPT load (every chat behind one system
    prompt) decode steps get shorter than with a read per row."""
    from evals.sim.instance_load import InstanceLoad
    from tokenlake.core.specs import load_hardware, load_model

    load = InstanceLoad([0, 1], LAT, load_model("llama-2-7b"), load_hardware("a100-80gb"))
    a = ((0, 5, 256), (0, 6, 256), (1, 2, 100))  # two segments on instance 0, one on 1
    b = ((0, 5, 256), (1, 3, 100))  # the first again, another slot on instance 1
    c = ((0, 5, 256), (0, 6, 256))
    assert load.grouped_saving([a]) == {}
    assert load.grouped_saving([a, b]) == {0: pytest.approx(LAT.c_prefix * 256)}
    assert load.grouped_saving([a, b, c]) == {0: pytest.approx(LAT.c_prefix * (256 + 256 + 256))}

    per_row, grouped = _per_row_and_grouped("tokenlake")
    assert grouped.mean_tbt_s < 0.8 * per_row.mean_tbt_s


def test_grouped_reads_give_the_baselines_a_cascade_over_the_common_prefix():
    """The same rule for the baselines' workers: a decode batch reads the prefix all its
    requests share once (vLLM's cascade kernel), so a MoonCake-style decode worker's steps
    get shorter behind a shared system prompt too."""
    from array import array

    from evals.sim.unpooled import common_prefix

    assert common_prefix([array("i", [1, 2, 3, 4]), array("i", [1, 2, 9]), array("i", [1, 2, 3])]) == 2
    assert common_prefix([array("i", [5, 6]), array("i", [1, 6])]) == 0
    assert common_prefix([array("i", [1, 2])]) == 2
    per_row, grouped = _per_row_and_grouped("mooncake-1p3d")
    assert grouped.mean_tbt_s < 0.9 * per_row.mean_tbt_s  # 18% shorter here

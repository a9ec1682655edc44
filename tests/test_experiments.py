"""The §7 experiments on the simulator: a small one runs in seconds and writes its
CSV, JSON, figure and report; summaries agree with the rows they come from."""

from __future__ import annotations

import csv
import json
import math
import statistics

import pytest

from evals.experiments import _p90_goodput, build_workload, e2e, load_balance
from evals.report import write
from evals.sim.config import SimConfig


def test_workloads_scale_and_mix():
    small = build_workload("loogle", scale=0.008)
    assert len(small) == 8 and all(r.token_ids is not None for r in small)
    mixed = build_workload("mixed", scale=0.03)
    assert {r.request_id.split(":")[0] for r in mixed} == {"loogle", "scbench", "sharegpt"}
    assert len({r.request_id for r in mixed}) == len(mixed)
    with pytest.raises(ValueError):
        build_workload("nope")


def test_p90_goodput_is_the_highest_rate_meeting_the_slo():
    rows = [{"rate": 1, "slo_attainment": 1.0}, {"rate": 2, "slo_attainment": 0.95},
            {"rate": 4, "slo_attainment": 0.5}, {"rate": 8, "slo_attainment": 0.92}]
    assert _p90_goodput(rows) == 8
    assert _p90_goodput(rows[:3]) == 2
    assert _p90_goodput([{"rate": 1, "slo_attainment": 0.1}]) == 0.0


def highest_rate_meeting_slo(rows, system):
    """The P90 goodput of one system, read off its rows here: the highest rate at which
    at least 90% of requests met their SLO, 0.0 if none."""
    met = sorted(r["rate"] for r in rows if r["system"] == system and r["slo_attainment"] >= 0.9)
    return met[-1] if met else 0.0


def test_small_e2e_experiment_writes_rows_report_and_figure(tmp_path):
    """A small cluster with a tight SLO, so that the goodputs differ: one system meets the
    SLO at no rate, another up to a rate inside the grid."""
    systems = ("tokenlake", "mooncake-1p3d", "sglang-router")
    rates = (1.0, 4.0, 8.0, 50.0)
    res = e2e(("loogle",), systems, {"loogle": rates}, scale=0.02,
              config=SimConfig(instances=4, slo_scale=2.0), seed=1)
    assert len(res.rows) == len(rates) * len(systems)
    assert all(r["requests"] == 20 for r in res.rows)  # every request finished
    good = {s: highest_rate_meeting_slo(res.rows, s) for s in systems}
    assert res.summary["p90_goodput"] == {"loogle": good}
    ratio = {}
    for s in systems[1:]:
        ratio[s] = good["tokenlake"] / good[s] if good[s] else math.inf
    assert res.summary["p90_goodput_ratio"] == {"loogle": pytest.approx(ratio)}
    # The case exercises both ends: a goodput inside the grid and one of zero.
    assert any(rates[0] < g < rates[-1] for g in good.values()) and 0.0 in good.values()
    for s in systems:  # each system at its own knee, and at the next rate up
        k = res.summary["at_knee"]["loogle"][s]
        mine = {r["rate"]: r for r in res.rows if r["system"] == s}
        if good[s]:
            assert k["rate"] == good[s] and k["knee"]["hit_rate"] == mine[good[s]]["hit_rate"]
        else:
            assert k["rate"] is None and k["knee"] is None
        above = [x for x in rates if x > good[s]]
        if above:
            assert k["next"]["rate"] == above[0] and k["next"]["slo_attainment"] < 0.9
            assert k["next"]["tbt_slo_attainment"] == mine[above[0]]["tbt_slo_attainment"]
    files = write(res, tmp_path)
    with open(files["rows"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(res.rows) and {r["system"] for r in rows} == set(systems)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["experiment"] == "e2e" and len(doc["rows"]) == len(res.rows)
    report = (tmp_path / "report.md").read_text()
    assert "P90 goodput" in report
    for s in systems:  # the report's table shows the goodputs computed above
        assert f"| loogle | {s} | {good[s]:.2f} |" in report
    assert "Each system at its own knee" in report
    assert (tmp_path / "e2e_loogle.png").stat().st_size > 1000


def test_load_balance_records_a_cv_series_per_system():
    systems = ("tokenlake", "mooncake-3p1d")
    res = load_balance("loogle", rate=2.0, systems=systems, scale=0.008)
    for s in systems:
        series = res.series[s]["cv"]
        assert series, s
        # The summary's mean CV is the mean over the time windows of the CV series.
        assert res.summary["mean_cv"][s] == pytest.approx(statistics.fmean(series), rel=1e-12)
        assert next(r["cv"] for r in res.rows if r["system"] == s) == res.summary["mean_cv"][s]
    tl = statistics.fmean(res.series["tokenlake"]["cv"])
    want = statistics.fmean(res.series["mooncake-3p1d"]["cv"]) / tl
    assert res.summary["cv_ratio_to_tokenlake"] == {"mooncake-3p1d": pytest.approx(want)}


def test_simulator_hit_rate_equals_the_real_engines_on_the_same_trace():
    """Validation (issues #6, #20): the same trace with a hot document through SmolLM2 on
    real engines (one compute engine per instance, DoP 2 prefill, replication every
    iteration) and through the simulator gives exactly the same hit rate and iteration
    count, and reports what `tokenlake eval validate --json` promises (latency and busy
    time are compared there, not asserted here: they are measurements)."""
    from evals.validate import validate

    out = validate(documents=2, questions=2, doc_tokens=200, instances=2, segment_tokens=64,
                   chunk_tokens=128, hot=1)
    assert out["hit_rate"]["real"] > 0.3
    assert out["hit_rate"]["equal"], out["hit_rate"]
    assert out["iterations"]["real"] == out["iterations"]["sim"]
    assert out["instances"] == 2 and out["max_dop"] == 2
    assert out["iteration_latency_error"] >= 0 and out["per_instance_busy_error"] >= 0
    assert len(out["query_busy_s"]["real"]) == len(out["query_busy_s"]["sim"]) == 2
    assert all(b > 0 for b in out["query_busy_s"]["real"] + out["query_busy_s"]["sim"])
    lat = out["latency_model"]  # the model's machine against this one, never silently
    assert lat["this_machine"]["cores"] >= 1 and lat["measured_on"] is not None
    assert lat["same_machine"] == (lat["measured_on"] == lat["this_machine"])


def test_parallel_workers_give_the_same_rows_as_one_process():
    """Each simulation is seeded by its config, so forked workers change nothing but
    the wall time; every label is reported once."""
    kw = dict(workloads=("loogle",), systems=("tokenlake", "sglang-router"),
              rates={"loogle": (1.0, 8.0)}, scale=0.008, seed=3)
    drop = ("sim_wall_s", "sim_cpu_s", "events_per_s", "iterations_per_s")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in drop} for r in rows]  # noqa: E731
    seen: list[str] = []
    serial = e2e(**kw)
    parallel = e2e(**kw, progress=lambda label, total: seen.append((label, total)), workers=2)
    assert strip(parallel.rows) == strip(serial.rows)
    assert sorted(seen) == sorted((f"e2e loogle {s} {r}/s", 4) for s in kw["systems"]
                                  for r in (1.0, 8.0))
    with pytest.raises(ValueError):
        e2e(**kw, workers=0)


def test_mixed_takes_a_third_of_each_workload_at_its_own_lengths():
    mixed = build_workload("mixed", scale=0.03)
    for part in ("loogle", "scbench", "sharegpt"):
        alone = build_workload(part, scale=0.01)  # a third of the count...
        mine = [r for r in mixed if r.request_id.startswith(part + ":")]
        assert len(mine) == len(alone)
    longest = max(r.input_length for r in mixed if r.request_id.startswith("loogle:"))
    assert longest > max(r.input_length for r in build_workload("loogle", scale=0.01))


def test_hit_rate_on_a_trace_reports_the_counted_reuse_and_reaches_it_unbounded(tmp_path):
    """``eval hit-rate --trace``: with a cache that holds everything and requests far
    apart, TokenLake's hit rate is the reuse counted from the trace's block ids in whole
    pages (the last prompt token computed), exactly."""
    import json

    from evals.experiments import hit_rate
    from evals.sim.config import SimConfig

    lines = []
    for i in range(12):  # sessions of growing prompts sharing their first blocks
        blocks = list(range(100 * (i % 3), 100 * (i % 3) + 1 + i // 3)) + [1000 + i]
        length = 512 * (len(blocks) - 1) + 300  # the last block partial, and its own
        lines.append(json.dumps({"timestamp": 60_000 * i, "input_length": length,
                                 "output_length": 4, "hash_ids": blocks}))
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    res = hit_rate(cache_gb=(200.0,), systems=("tokenlake", "sglang-router"),
                   config=SimConfig(instances=4), trace=str(trace))
    at = res.summary["hit_rate"]["200.0"]
    assert at["tokenlake"] == pytest.approx(res.summary["counted_reuse_pages"], abs=1e-12)
    assert 0 < res.summary["counted_reuse_pages"] <= res.summary["counted_reuse"]


def test_zipf_skews_loogle_documents_and_zero_keeps_the_uniform_counts():
    from collections import Counter

    from evals.workloads.loogle import synthetic_loogle

    def per_doc(reqs):
        return Counter(r.request_id.rsplit("-q", 1)[0] for r in reqs)

    uniform = list(synthetic_loogle(300, seed=4, doc_tokens=64).requests())
    assert uniform == list(synthetic_loogle(300, seed=4, doc_tokens=64, zipf=0.0).requests())
    skewed = list(synthetic_loogle(300, seed=4, doc_tokens=64, zipf=1.2).requests())
    assert skewed == list(synthetic_loogle(300, seed=4, doc_tokens=64, zipf=1.2).requests())
    assert len(skewed) == 300 and len({r.request_id for r in skewed}) == 300
    top_u, top_s = per_doc(uniform).most_common(1)[0][1], per_doc(skewed).most_common(1)[0][1]
    assert top_u <= 25 < top_s  # uniform counts are at most 25; the head is hot
    docs = {}
    for r in skewed:  # the questions of one document share it as an exact prefix
        docs.setdefault(r.request_id.rsplit("-q", 1)[0], set()).add(r.token_ids[:40])
    assert all(len(p) == 1 for p in docs.values()) and len(docs) > 1
    with pytest.raises(ValueError, match="skews LooGLE"):
        build_workload("sharegpt", scale=0.01, zipf=1.0)
    with pytest.raises(ValueError, match="zipf"):
        synthetic_loogle(10, zipf=-1.0)


def test_e2e_on_a_trace_and_the_report_warnings(tmp_path):
    """``eval e2e --trace``: the trace's own times sped up, each point labelled with its
    mean rate; a grid where every system meets the SLO at the top rate, and a scale
    below 1, are warned about in the report."""
    from evals.report import warnings
    from evals.sim.trace import TRACE_SPEEDUPS

    lines = [json.dumps({"timestamp": 2_000 * i, "input_length": 600, "output_length": 2,
                         "hash_ids": [i % 3, 50 + i]}) for i in range(10)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    res = e2e(systems=("tokenlake",), config=SimConfig(instances=2), trace=str(trace))
    label = "trace:t.jsonl"
    rates = [r["rate"] for r in res.rows]
    assert rates == [round(10 * f / 18.0, 3) for f in TRACE_SPEEDUPS]
    assert all(r["workload"] == label and r["requests"] == 10 for r in res.rows)
    assert res.summary["p90_goodput"][label]["tokenlake"] == max(rates)  # easy load
    assert any("saturates" in w for w in warnings(res))
    write(res, tmp_path / "out")
    assert "saturates" in (tmp_path / "out" / "report.md").read_text()
    small = e2e(("loogle",), ("tokenlake",), {"loogle": (1.0,)}, scale=0.01,
                config=SimConfig(instances=2))
    assert any("scale 0.01 < 1" in w for w in warnings(small))
    poisson = e2e(systems=("tokenlake",), rates={"trace": (0.5, 2.0)},
                  config=SimConfig(instances=2), trace=str(trace))
    assert [r["rate"] for r in poisson.rows] == [0.5, 2.0]

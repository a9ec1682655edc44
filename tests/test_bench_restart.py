"""``tokenlake bench restart`` in one small round: the adopting restart answers from the
cache with the same text, the cold one from nothing, and nothing it started outlives it
(no serve, no engine, no shared buffer)."""

from __future__ import annotations

import pytest

from tokenlake.dataplane.shm_files import cluster_prefix, list_buffers, pid_alive
from tokenlake.tools.bench.restart import METRICS, MODES, RestartConfig, bench_restart, print_report


@pytest.fixture(scope="module")
def result():
    # 1 instance of 32 MiB: the smallest pool that holds the demo document (16 MiB: 320 tokens)
    return bench_restart(RestartConfig(rounds=1, instances=1, pool_mb=32, start_timeout_s=180))


def test_adopting_restart_answers_from_the_cache_and_the_cold_one_does_not(result):
    adopt, cold = ({r["mode"]: r for r in result["rounds"]}[m] for m in MODES)
    assert adopt["cached_tokens"] > 0 and adopt["cached_tokens"] >= 0.9 * adopt["cached_tokens_before_kill"]
    assert adopt["same_text"] and adopt["restored"] > 0
    assert cold["cached_tokens"] == 0 and cold["restored"] is None and cold["cached_tokens_before_kill"] > 0
    assert cold["same_text"]  # greedy: the same answer, computed again
    assert adopt["exit_code"] == cold["exit_code"] == 0


def test_the_report_has_every_figure(result):
    assert result["settings"]["instances"] == 1 and result["settings"]["pool_mb"] == 32
    assert not result["settings"]["default_sizes"]
    assert "isa" in result and len(result["rounds"]) == 2
    for mode in MODES:
        for metric in METRICS:
            s = result["summary"][mode][metric]
            assert 0 < s["min"] <= s["median"] <= s["max"]
        r = next(r for r in result["rounds"] if r["mode"] == mode)
        assert r["restart_to_ready_s"] < r["restart_to_first_cached_answer_s"]
    assert set(result["ratios"]) == {"restart_to_ready", "restart_to_first_cached_answer"}
    assert all(v > 0 for v in result["ratios"].values())
    assert result["cached_tokens"]["adopt"]["after_restart"][0] > 0
    assert result["cached_tokens"]["cold"]["after_restart"] == [0]


def test_nothing_it_started_is_left(result):
    for r in result["rounds"]:
        assert r["leftover_engines"] == r["leftover_buffers"] == r["leftover_files"] == [], r
        assert r["engine_pids"] and not any(map(pid_alive, r["engine_pids"]))
        assert r["cluster_ids"] and not any(list_buffers(cluster_prefix(c)) for c in r["cluster_ids"])
    cold = next(r for r in result["rounds"] if r["mode"] == "cold")
    assert len(cold["cluster_ids"]) == 2 and 0 <= cold["engines_gone_after_kill_s"] < 30


def test_the_table_names_both_modes_and_the_ratio(result, capsys):
    print_report(result)
    out = capsys.readouterr().out
    assert "adopt" in out and "cold" in out and "cold/adopt" in out and "restart to ready" in out

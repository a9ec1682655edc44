"""``tokenlake bench e2e``'s decode summary: the ratio of the medians, and each round's own
ratio (its pool run against the reference run beside it) with their median, so that drift
between rounds on a shared machine is seen rather than averaged into the headline."""

from __future__ import annotations

from tokenlake.tools.bench.e2e import _decode_summary, summary


def test_each_round_is_paired_with_the_reference_run_beside_it():
    # the machine halves its speed in round 2: the medians' ratio mixes rounds, the pairs do not
    runs = {1: {"pool": [24.0, 12.0, 25.0], "reference": [20.0, 10.0, 20.0], "layer_ms": [0.2, 0.3]},
            8: {"pool": [90.0, 100.0], "reference": [30.0, 40.0], "layer_ms": []}}
    pool, reference, rows = _decode_summary(runs, 3)
    assert pool == {1: 24.0, 8: 95.0} and reference == {1: 20.0, 8: 35.0}
    one = rows["1"]
    assert one["ratio"] == 24.0 / 20.0
    assert one["ratio_by_round"] == [1.2, 1.2, 1.25] and one["ratio_paired"] == 1.2
    assert one["pool_range"] == [12.0, 25.0] and one["layer_query_ms"] == 0.25
    assert rows["8"]["ratio_paired"] == (3.0 + 2.5) / 2 and rows["8"]["layer_query_ms"] is None
    text = summary({"cached_ttft_ms": 100.0, "recompute_ttft_ms": 6000.0, "pool_decode_tok_s": 24.0,
                    "reference_decode_tok_s": 20.0, "decode_by_batch": rows, "vllm": None, "dop_ttft": {}})
    assert "decode, 1 request(s): 1.20x the reference (medians); by round 1.20, 1.20, 1.25" in text

"""``tokenlake demo`` (shortened answers): what its report claims, checked from the report's
own token ids and counts: every answer equals the reference engine's, each hit is the
whole cached segments of what earlier waves stored, the hit rate and the access-load CV
are what the per-request hits and the per-instance accesses give."""

import json
import math

import pytest
from token_util import common_prefix

from tokenlake.tools.demo import DemoConfig, run_demo

CONFIG = DemoConfig(max_new_tokens=6)
#: The demo's waves: later waves may reuse what earlier ones stored, never the reverse.
WAVES = (("q0",), ("q1", "q2", "q3", "s0"), ("s1",))


@pytest.fixture(scope="module")
def report():
    return run_demo(CONFIG, progress=lambda *_: None)


def test_report_is_json_and_every_answer_equals_the_reference(report):
    json.dumps(report)  # serialisable as printed by --json
    assert {"reference_match", "requests", "instances", "cv", "hit_rate"} <= set(report)
    assert report["reference_match"] is True
    assert all(r["matches_reference"] for r in report["requests"])
    assert sorted(r["request_id"] for r in report["requests"]) == sorted(sum(WAVES, ()))
    for r in report["requests"]:
        assert r["prompt_tokens"] == len(r["prompt_token_ids"]) > 0
        assert 1 <= len(r["output_token_ids"]) <= CONFIG.max_new_tokens


def test_hits_are_the_cached_segments_of_earlier_waves(report):
    """A request's hit is its longest common prefix with a sequence an earlier wave
    stored (prompt and output, but the last output token, whose KV is never computed),
    rounded down to whole pages, at most the prompt less one token."""
    c, page = report["segment_tokens"], report["page_tokens"]
    assert c % page == 0 and page < c
    by_id = {r["request_id"]: r for r in report["requests"]}
    stored: list[list[int]] = []
    for wave in WAVES:
        for rid in wave:
            prompt = by_id[rid]["prompt_token_ids"]
            shared = max((common_prefix(prompt, s) for s in stored), default=0)
            assert by_id[rid]["hit_tokens"] == min(shared, len(prompt) - 1) // page * page, rid
        stored += [by_id[rid]["prompt_token_ids"] + by_id[rid]["output_token_ids"][:-1]
                   for rid in wave]
    # What the demo sets out to show: the document is reused, and the session's second
    # turn reuses more than its first (its whole first turn).
    assert by_id["q0"]["hit_tokens"] == 0
    assert all(by_id[f"q{i}"]["hit_tokens"] > 0 for i in range(1, 4))
    assert by_id["s1"]["hit_tokens"] > by_id["s0"]["hit_tokens"]
    hits = sum(r["hit_tokens"] for r in report["requests"])
    assert report["hit_rate"] == pytest.approx(
        hits / sum(r["prompt_tokens"] for r in report["requests"]), rel=1e-12)
    # The pool holds at least one slot per distinct whole segment stored.
    distinct = {tuple(s[: k * c]) for s in stored for k in range(1, len(s) // c + 1)}
    assert sum(i["segments"] for i in report["instances"]) >= len(distinct)


def test_cv_is_that_of_the_per_instance_accesses(report):
    assert [i["instance"] for i in report["instances"]] == list(range(CONFIG.instances))
    accesses = [i["accesses"] for i in report["instances"]]
    assert sum(accesses) > 0
    mean = sum(accesses) / len(accesses)
    std = math.sqrt(sum((a - mean) ** 2 for a in accesses) / len(accesses))
    assert report["cv"] == pytest.approx(std / mean, rel=1e-12)

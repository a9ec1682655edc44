"""``tokenlake demo`` (shortened answers): every answer equals the reference engine's,
later questions reuse the shared prefix, and the JSON report has the documented keys."""

import json

from tokenlake.tools.demo import DemoConfig, run_demo


def test_demo_report():
    report = run_demo(DemoConfig(max_new_tokens=6), progress=lambda *_: None)
    json.dumps(report)  # serialisable as printed by --json
    assert report["reference_match"] is True
    assert {"reference_match", "requests", "instances", "cv"} <= set(report)
    by_id = {r["request_id"]: r for r in report["requests"]}
    assert by_id["q0"]["hit_tokens"] == 0
    assert all(by_id[f"q{i}"]["hit_tokens"] > 0 for i in range(1, 4))
    assert by_id["s1"]["hit_tokens"] > by_id["s0"]["hit_tokens"]
    for r in report["requests"]:
        assert r["prompt_token_ids"] and r["output_token_ids"]
    assert len(report["instances"]) == 4
    assert sum(i["segments"] for i in report["instances"]) > 0
    assert 0.0 <= report["cv"]

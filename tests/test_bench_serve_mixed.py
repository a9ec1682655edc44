"""``tokenlake bench serve --mixed`` (issue #39) without the real model: the compute-engine
worker against an in-process served TINY pool (float32 and bfloat16), a wrong reference
and an unrounded one caught, the report's statistics on known numbers, the worker
processes beside an HTTP load (stub servers) through ``run_bench``, and the command line's
refusals and exit status."""

from __future__ import annotations

import threading

import pytest
import torch
from dataplane_util import TINY
from test_bench_serve import (
    Stub,
    config,
    run_cli,
    serve_stub,  # noqa: F401 (the fixture, found by its name)
)

import tokenlake
from tokenlake.dataplane import credentials
from tokenlake.deploy.local import LocalCluster
from tokenlake.service.server import ControlServer
from tokenlake.tools.bench.serve import run_bench
from tokenlake.tools.bench.serve_mixed import MixedSpec
from tokenlake.tools.bench.serve_stats import http_check, mixed_report, worker_summary
from tokenlake.tools.bench.serve_worker import PoolWorker, WorkerOptions, WorkerStats
from tokenlake.tools.synthetic_kv import KVShape, query_rows, reference_partial, stable_seed

C = 16
POOL_BYTES = 96 * TINY.num_layers * 2 * TINY.num_kv_heads * C * TINY.head_dim * 4
SUMMARY_KEYS = {"worker", "session", "iterations", "iterations_per_s", "tokens_per_s",
                "latency_p50_ms", "latency_p99_ms", "errors", "wrong_answers", "worst_error",
                "waits_in_flight"}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def served(request):
    """A two-instance TINY pool served on a control port (credentials where
    ``tokenlake.connect`` looks); yields ``(cluster, server)``."""
    with LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=128,
                      kv_dtype=request.param) as cluster, ControlServer(cluster) as server:
        path = credentials.write(credentials.default_path(server.address), server.credentials())
        try:
            yield cluster, server
        finally:
            credentials.remove(path)


def drive(server, worker: int, limit: int, reference=reference_partial) -> tuple[WorkerStats, int]:
    """One worker's ``limit`` iterations on the served pool; its stats and session."""
    stats = WorkerStats()
    with tokenlake.connect(server.address, timeout_s=30.0, label=f"test-{worker}") as cp:
        w = PoolWorker(cp, WorkerOptions(worker=worker, seed=worker), reference)
        shape = w.setup()
        assert (shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim) == \
            (TINY.num_layers, TINY.num_q_heads, TINY.num_kv_heads, TINY.head_dim)
        assert w.segment_tokens == C and shape.max_rows == 128
        w.drive(stats, limit=limit)
        return stats, cp.session.session


# --------------------------------------------------------------------------- the worker


def test_two_workers_share_a_document_and_every_layer_is_exact(served):
    cluster, server = served
    out: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, drive(server, i, 12)))
               for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(out) == [0, 1], "a worker failed"
    (a, sa), (b, sb) = out[0], out[1]
    assert sa != sb
    for stats in (a, b):
        assert (stats.iterations, stats.errors, stats.wrong_answers) == (12, 0, 0), \
            stats.error_samples
        assert 0 < stats.worst_error < 1e-4  # compared with something, and close to it
        assert stats.layers_checked == 12 * TINY.num_layers  # one span per iteration
        assert len(stats.latencies_s) == 12 and stats.active_s > 0
    # the shared document was read back from the pool (one worker's segments, the other's)
    assert a.hit_tokens + b.hit_tokens > 0
    summary = worker_summary(a, 0, sa)
    assert set(summary) >= SUMMARY_KEYS
    assert summary["latency_p50_ms"] <= summary["latency_p99_ms"]
    assert not [r for r in cluster.control.live_requests if r.startswith(f"{sa}/")]
    cluster.control.check()


def test_a_reference_wrong_once_is_one_wrong_answer(served):
    _cluster, server = served
    calls = []

    def wrong_on_the_third(tokens, prefix, q, layer, shape):
        calls.append(layer)
        if len(calls) == 3:  # the neighbouring layer's K/V, once
            layer = (layer + 1) % shape.num_layers
        return reference_partial(tokens, prefix, q, layer, shape)

    stats, _ = drive(server, 5, 8, wrong_on_the_third)
    assert len(calls) > 3
    assert (stats.iterations, stats.wrong_answers) == (8, 1)
    assert stats.worst_error > 1e-2


def test_a_reference_not_rounded_to_the_pool_dtype_is_caught_in_bfloat16(served):
    cluster, server = served

    def unrounded(tokens, prefix, q, layer, shape):
        return reference_partial(tokens, prefix, q, layer, KVShape(
            shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
            shape.max_rows, "float32"))

    stats, _ = drive(server, 6, 6, unrounded)
    if cluster.kv_dtype == "float32":
        assert stats.wrong_answers == 0  # the same reference there
    else:  # bfloat16 rounding (~4e-3 relative) is far beyond the 1e-4 tolerance
        assert stats.wrong_answers > 0
        assert stats.worst_error > 1e-3


def test_query_rows_are_the_same_in_every_process():
    shape = KVShape(2, 4, 2, 16, 8)
    q = query_rows("w0-r1", 5, 3, 1, shape)
    assert q.shape == (3, 4, 16) and q.dtype == torch.float32
    assert torch.equal(q, query_rows("w0-r1", 5, 3, 1, shape))
    assert not torch.equal(q, query_rows("w0-r1", 5, 3, 0, shape))
    assert stable_seed("w0-r1", 5, 1) == 3108750123913540552  # a fixed digest, not hash()


# --------------------------------------------------------------------------- the report


def test_worker_summary_and_totals_on_known_numbers():
    stats = WorkerStats(iterations=100, tokens=300, active_s=2.0,
                        latencies_s=[i / 1000 for i in range(100, 0, -1)], errors=1,
                        wrong_answers=2, worst_error=0.5, waits_in_flight=7)
    stats.error_samples["EngineUnavailable: gone"] += 1
    s = worker_summary(stats, 1, 9)
    assert s["latency_p50_ms"] == pytest.approx(50.5)
    assert s["latency_p99_ms"] == pytest.approx(99.01)
    assert (s["iterations_per_s"], s["tokens_per_s"]) == (50.0, 150.0)
    assert (s["worker"], s["session"], s["errors"], s["wrong_answers"], s["waits_in_flight"]) \
        == (1, 9, 1, 2, 7)
    assert s["error_samples"] == {"EngineUnavailable: gone": 1}
    empty = worker_summary(WorkerStats(), 0, 3)
    assert empty["latency_p50_ms"] is None and empty["iterations_per_s"] is None
    http = http_check({"pool": {"errors": 2}, "baseline": {}, "answers_compared": 30,
                       "answers_differ": 1})
    assert http == {"errors": 2, "checked": True, "answers_compared": 30, "wrong_answers": 1}
    unchecked = http_check({"errors": 0, "requests": 4})
    assert unchecked["checked"] is False and unchecked["wrong_answers"] is None
    report = mixed_report([s, {**empty, "errors": 3}], http)
    assert [w["worker"] for w in report["workers"]] == [0, 1]
    assert (report["wrong_answers"], report["errors"]) == (2, 4)


# --------------------------------------------------------------------------- processes


def test_worker_processes_run_beside_the_http_load_and_stop_with_it(served, request, capfd):
    cluster, server = served
    if cluster.kv_dtype != "float32":
        pytest.skip("one pool dtype is enough for the processes")
    start_stub = request.getfixturevalue("serve_stub")
    pool, base = start_stub(Stub(gap_s=0.02)), start_stub(Stub(gap_s=0.001))
    mixed = MixedSpec(2, address=server.address)
    result = run_bench(config(rounds=2, warmup=0, mixed=mixed), pool, base)
    m = result["mixed"]
    assert [w["worker"] for w in m["workers"]] == [0, 1]
    assert len({w["session"] for w in m["workers"]}) == 2
    for w in m["workers"]:
        assert set(w) >= SUMMARY_KEYS and not w.get("lost"), w
        assert w["iterations"] >= 2 and w["errors"] == 0 and w["wrong_answers"] == 0, w
        assert w["latency_p50_ms"] > 0 and w["worst_error"] < 1e-4
    assert (m["wrong_answers"], m["errors"]) == (0, 0)
    assert m["http"] == {"errors": 0, "checked": True, "answers_compared": 24,
                         "wrong_answers": 0}
    assert result["config"]["mixed"] == 2 and result["pool"]["requests"] == 24
    assert len(server.sessions) == 0  # every worker closed its session
    err = capfd.readouterr().err
    for line in ("worker 0 ready", "worker 1 ready", "worker 0 paused", "worker 1 done"):
        assert line in err, err
    assert err.count("workers run while the HTTP load runs") == 2  # the pool's two runs


def test_a_fixed_number_of_iterations_per_worker(served, request):
    cluster, server = served
    if cluster.kv_dtype != "bfloat16":
        pytest.skip("runs on the bfloat16 pool")
    start_stub = request.getfixturevalue("serve_stub")
    result = run_bench(config(warmup=0, mixed=MixedSpec(1, 5, server.address)),
                       start_stub(Stub()))
    (w,) = result["mixed"]["workers"]
    assert (w["iterations"], w["errors"], w["wrong_answers"]) == (5, 0, 0), w
    assert result["mixed"]["http"]["checked"] is False
    assert result["completed"] == 12


# --------------------------------------------------------------------------- command line


def test_mixed_options_that_cannot_run_are_refused_in_one_line(capsys):
    for argv in (["--launch", "--mixed", "1", "--launch-args", "--engine reference"],
                 ["--launch", "--mixed", "1", "--launch-args", "--engine=reference"],
                 ["--base-url", "http://x", "--mixed", "2"],
                 ["--base-url", "http://x", "--mixed", "1", "--control-address", "localhost:7400"],
                 ["--launch", "--mixed", "1", "--control-address", "tcp://127.0.0.1:7400"],
                 ["--base-url", "http://x", "--control-address", "tcp://127.0.0.1:7400"],
                 ["--base-url", "http://x", "--mixed-iterations", "3"],
                 ["--launch", "--mixed", "-1"],
                 ["--launch", "--mixed", "1", "--mixed-iterations", "0"]):
        code, out, err = run_cli(["bench", "serve", *argv], capsys)
        assert code == 2, argv
        assert err.startswith("tokenlake: error: ") and len(err.splitlines()) == 1, err
    code, out, _ = run_cli(["bench", "serve", "--help"], capsys)
    for flag in ("--mixed", "--mixed-iterations", "--control-address"):
        assert flag in out


def test_a_wrong_answer_makes_the_exit_status_non_zero(monkeypatch, capsys):
    import tokenlake.tools.bench.serve as bench

    seen = {}

    def fake(config, base_url, baseline_url, launch):
        seen["mixed"] = config.mixed
        w = worker_summary(WorkerStats(iterations=3, latencies_s=[0.1] * 3, active_s=1.0,
                                       wrong_answers=seen["wrong"]), 0, 1)
        result = {"requests": 1, "errors": 0, "throughput_rps": 1.0, "output_tokens_per_s": 1.0,
                  "hit_rate": None, "ttft_ms": None, "tbt_ms": None, "e2e_ms": None,
                  "error_samples": {}}
        result["mixed"] = mixed_report([w], http_check(result))
        return result

    monkeypatch.setattr(bench, "run_bench", fake)
    argv = ["bench", "serve", "--base-url", "http://x", "--mixed", "1", "--control-address",
            "tcp://127.0.0.1:7400", "--mixed-iterations", "4"]
    for wrong, status in ((0, 0), (1, 1)):
        seen["wrong"] = wrong
        code, out, _ = run_cli(argv, capsys)
        assert code == status, out
        assert "worker 0 (session 1): 3 iterations" in out
    assert seen["mixed"] == MixedSpec(1, 4, "tcp://127.0.0.1:7400", ready_timeout_s=300.0,
                                      pause_timeout_s=300.0)

"""``tokenlake bench serve`` against stub OpenAI-compatible servers run in this process
(FastAPI under uvicorn in a thread): request and token counts, errors, the concurrency
cap, hit rates from /metrics or usage, pool-vs-baseline ratios, the statistics, the
command line, and the ``tokenlake serve`` launcher (on a stand-in process)."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import threading
from contextlib import ExitStack

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tokenlake.tools import cli
from tokenlake.tools.bench.serve import BenchConfig, Load, arrival_offsets, run_bench, send_one
from tokenlake.tools.bench.serve_load import (
    RESERVED_IDS,
    BenchRequest,
    LaunchedServer,
    WorkloadSpec,
    build_workload,
    parse_ready_line,
    serve_command,
)
from tokenlake.tools.bench.serve_stats import (
    Outcome,
    distribution,
    format_report,
    parse_metrics,
    percentile,
    summarise,
)

MODEL = "stub-model"
SPEC = WorkloadSpec("loogle", num_requests=12, max_tokens=5, doc_tokens=64,
                    questions_per_doc=3)
STAT_KEYS = {"p50", "p90", "p99", "mean"}


class Stub:
    """An OpenAI-compatible completion server that streams ``max_tokens`` chunks of one
    character ``gap_s`` apart. Prompts whose last token is divisible by ``reject_mod``
    get HTTP 400, by ``drop_mod`` a stream cut off after two tokens, equal to
    ``hang_token`` no answer at all. Usage reports ``cached_tokens`` = prompt // 4;
    with ``metrics`` the pool counters count half of every prompt as hits."""

    def __init__(self, gap_s: float = 0.002, metrics: bool = True, reject_mod: int = 0,
                 drop_mod: int = 0, hang_token: int | None = None, odd_mod: int = 0,
                 together: tuple[int, int] | None = None) -> None:
        self.gap_s, self.reject_mod, self.drop_mod = gap_s, reject_mod, drop_mod
        # (skip, n): after the first ``skip`` requests (warm-ups), streams start once n
        # are in flight at once (the first wave's: the client's concurrency, not timing)
        self.together, self._wave = together, None
        self.odd_mod = odd_mod  # answers "y" instead of "x" to these prompts
        self.hang_token = hang_token
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.hit = self.lookup = 0
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)
        if metrics:
            self.app.get("/metrics")(self.metrics)

    async def models(self):
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def metrics(self):
        return PlainTextResponse(
            "# TYPE tokenlake_hit_tokens_total counter\n"
            f'tokenlake_hit_tokens_total{{pool="0"}} {self.hit}\n'
            f"tokenlake_lookup_tokens_total {self.lookup}\n")

    async def completions(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        prompt = body["prompt"]
        if self.reject_mod and prompt[-1] % self.reject_mod == 0:
            return JSONResponse({"error": {"message": "rejected", "type": "invalid_request_error",
                                           "code": 400}}, status_code=400)
        self.lookup += len(prompt)
        self.hit += len(prompt) // 2
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return StreamingResponse(self._stream(prompt, body["max_tokens"]),
                                 media_type="text/event-stream")

    async def _stream(self, prompt: list[int], max_tokens: int):
        try:
            if self.together and len(self.bodies) > self.together[0]:
                if self._wave is None:
                    self._wave = asyncio.Event()
                if self.in_flight >= self.together[1]:
                    self._wave.set()
                await asyncio.wait_for(self._wave.wait(), 30)
            if prompt[-1] == self.hang_token:
                await asyncio.Event().wait()
            for i in range(max_tokens):
                if self.drop_mod and prompt[-1] % self.drop_mod == 0 and i == 2:
                    return
                await asyncio.sleep(self.gap_s)  # the stub's decode step
                chunk = {"id": "c", "object": "text_completion",
                         "choices": [{"index": 0, "text": "y" if self.odd_mod and
                                      prompt[-1] % self.odd_mod == 0 else "x", "finish_reason":
                                      "length" if i == max_tokens - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                     "total_tokens": len(prompt) + max_tokens,
                     "prompt_tokens_details": {"cached_tokens": len(prompt) // 4}}
            yield f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


@pytest.fixture
def serve_stub():
    """``serve_stub(stub) -> base URL``: runs the stub on a free port until the test ends."""
    running: list[tuple[uvicorn.Server, threading.Thread, socket.socket]] = []

    def start(stub: Stub) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)  # connections wait in the backlog until the server accepts them
        server = uvicorn.Server(uvicorn.Config(stub.app, log_level="error", lifespan="off",
                                               timeout_graceful_shutdown=2))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        running.append((server, thread, sock))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, thread, sock in running:
        server.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive(), "a stub server did not stop"


def config(**changes) -> BenchConfig:
    base = {"spec": SPEC, "load": Load(concurrency=3, timeout_s=30), "warmup": 1}
    return BenchConfig(**{**base, **changes})


# --------------------------------------------------------------------------- statistics


def test_percentiles_interpolate_like_numpy():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    xs = random.Random(1).sample(range(10_000), 257)
    for p in (0, 50, 90, 99, 100):
        assert percentile(xs, p) == pytest.approx(np.percentile(xs, p))
    assert distribution([0.001, 0.003], scale=1e3) == pytest.approx(
        {"p50": 2.0, "p90": 2.8, "p99": 2.98, "mean": 2.0})
    assert distribution([]) is None
    with pytest.raises(ValueError):
        percentile([], 50)


def test_hit_rate_from_metrics_then_usage_then_none():
    text = ("# HELP x\ntokenlake_hit_tokens_total{a=\"1\"} 3\ntokenlake_hit_tokens_total{a=\"2\"} 4\n"
            "tokenlake_lookup_tokens_total 20.0\nother_total 5\n")
    assert parse_metrics(text) == {"tokenlake_hit_tokens_total": 7.0,
                                   "tokenlake_lookup_tokens_total": 20.0}
    assert parse_metrics("other_total 5\n") is None
    done = [Outcome("a", e2e_s=1.0, prompt_tokens=100, cached_tokens=30),
            Outcome("b", e2e_s=1.0, prompt_tokens=100, cached_tokens=10), Outcome("c", "boom")]
    before = {"tokenlake_hit_tokens_total": 7.0, "tokenlake_lookup_tokens_total": 20.0}
    after = {"tokenlake_hit_tokens_total": 57.0, "tokenlake_lookup_tokens_total": 220.0}
    r = summarise(done, 2.0, (before, after))
    assert (r["hit_rate"], r["hit_rate_source"]) == (0.25, "metrics")
    assert (r["requests"], r["completed"], r["errors"]) == (3, 2, 1)
    assert r["throughput_rps"] == 1.0 and r["error_samples"] == {"boom": 1}
    assert summarise(done, 2.0, (None, None))["hit_rate"] == 0.2
    assert summarise([Outcome("a", e2e_s=1.0)], 1.0)["hit_rate"] is None


# --------------------------------------------------------------------------- against stubs


def test_one_request_counts_tokens_gaps_and_usage(serve_stub):
    url = serve_stub(Stub()) + "/v1/completions"
    req = BenchRequest("r", tuple(range(100, 140)), 6)

    async def go() -> Outcome:
        async with httpx.AsyncClient() as client:
            return await send_one(client, url, MODEL, req, 30)

    out = asyncio.run(go())
    assert out.error is None and out.output_tokens == 6 and len(out.gaps_s) == 5
    assert 0 < out.ttft_s <= out.e2e_s and all(g > 0 for g in out.gaps_s)
    assert (out.prompt_tokens, out.cached_tokens) == (40, 10)


def test_closed_loop_counts_respects_concurrency_and_reads_metrics(serve_stub):
    stub = Stub(together=(2, 3))
    result = run_bench(config(warmup=2), serve_stub(stub))
    assert (result["requests"], result["completed"], result["errors"]) == (12, 12, 0)
    assert result["output_tokens"] == 12 * SPEC.max_tokens
    assert len(stub.bodies) == 12 + 2  # warm-ups are sent, not counted
    assert stub.max_in_flight == 3
    sent = build_workload(SPEC, 0)
    assert sorted(b["prompt"] for b in stub.bodies[2:]) == sorted(list(r.prompt) for r in sent)
    assert result["input_tokens"] == sum(len(r.prompt) for r in sent)
    body = stub.bodies[-1]
    assert body["model"] == MODEL and body["stream"] and body["ignore_eos"]
    assert body["temperature"] == 0 and body["stream_options"] == {"include_usage": True}
    assert result["hit_rate"] == pytest.approx(
        sum(len(r.prompt) // 2 for r in sent) / result["input_tokens"])
    assert result["hit_rate_source"] == "metrics"
    for key in ("ttft_ms", "tbt_ms", "e2e_ms"):
        assert set(result[key]) == STAT_KEYS
    assert result["ttft_ms"]["p50"] <= result["e2e_ms"]["p50"]
    assert result["duration_s"] > 0 and result["output_tokens_per_s"] > 0
    assert format_report(result).splitlines()[0].split() == ["requests", "(errors)", "12", "(0)"]


def test_errors_drops_and_timeouts_are_counted_not_waited_for(serve_stub):
    sent = build_workload(SPEC, 0)
    last = [r.prompt[-1] for r in sent]
    hang = next(t for t in last if t % 3 and t % 5)
    stub = Stub(metrics=False, reject_mod=3, drop_mod=5, hang_token=hang)
    result = run_bench(config(warmup=0, load=Load(concurrency=4, timeout_s=1.0)),
                       serve_stub(stub))
    rejected = sum(t % 3 == 0 for t in last)
    dropped = sum(t % 3 != 0 and t % 5 == 0 for t in last)
    hung = last.count(hang)
    assert result["errors"] == rejected + dropped + hung
    assert result["completed"] == 12 - result["errors"]
    samples = result["error_samples"]
    assert samples.get("HTTP 400: rejected", 0) == rejected
    assert samples.get("bad stream: the stream ended without [DONE]", 0) == dropped
    assert samples["timeout after 1 s"] == hung
    assert result["hit_rate_source"] == "usage"  # no /metrics: usage cached_tokens


def test_poisson_arrivals_are_seeded_and_paced(serve_stub):
    load = Load(concurrency=None, rate=40.0, seed=3, timeout_s=30)
    offsets = arrival_offsets(12, load)
    assert offsets == arrival_offsets(12, load) != arrival_offsets(12, Load(rate=40.0, seed=4))
    assert offsets == sorted(offsets) and offsets[0] > 0
    result = run_bench(config(load=load, warmup=0), serve_stub(Stub()))
    assert result["completed"] == 12 and result["duration_s"] >= offsets[-1]
    assert result["config"]["rate"] == 40.0


def test_baseline_rounds_medians_ranges_and_ratios(serve_stub):
    pool, base = Stub(gap_s=0.001), Stub(gap_s=0.02, metrics=False, odd_mod=3)
    result = run_bench(config(rounds=2, warmup=0), serve_stub(pool), serve_stub(base))
    odd = sum(x["prompt"][-1] % 3 == 0 for x in base.bodies)
    assert 0 < odd < 24
    assert (result["answers_compared"], result["answers_differ"]) == (24, odd)
    assert set(result) >= {"pool", "baseline", "ratios", "ratio_ranges", "config"}
    p, b, ratios = result["pool"], result["baseline"], result["ratios"]
    assert p["requests"] == b["requests"] == 24 and len(p["rounds"]) == 2
    assert ratios["ttft_p50"] == pytest.approx(b["ttft_ms"]["p50"] / p["ttft_ms"]["p50"])
    assert ratios["throughput_rps"] == pytest.approx(p["throughput_rps"] / b["throughput_rps"])
    assert ratios["tbt_p50"] > 1.5  # 20 ms vs 1 ms between tokens
    lo, hi = p["ranges"]["ttft_ms.p50"]
    assert lo <= p["ttft_ms"]["p50"] <= hi
    assert p["hit_rate_source"] == "metrics" and b["hit_rate_source"] == "usage"
    # each round a fresh seed: the second round's documents are new to the cache
    docs = [{tuple(x["prompt"][:32]) for x in s.bodies[i * 12:(i + 1) * 12]}
            for s in (pool,) for i in (0, 1)]
    assert not docs[0] & docs[1]
    for i in (0, 1):  # the same prompts to both servers in each round
        assert sorted(x["prompt"] for x in pool.bodies[i * 12:(i + 1) * 12]) \
            == sorted(x["prompt"] for x in base.bodies[i * 12:(i + 1) * 12])
    assert "baseline" in format_report(result)


# --------------------------------------------------------------------------- workloads


def test_workload_prompts_share_prefixes_and_stay_in_the_vocabulary(tmp_path):
    reqs = build_workload(SPEC, 0)
    assert len(reqs) == 12 and all(r.max_tokens == 5 for r in reqs)
    assert all(RESERVED_IDS <= t < 49152 for r in reqs for t in r.prompt)
    docs = {r.request_id.rsplit("-q", 1)[0]: r.prompt[:50] for r in reqs}
    assert all(r.prompt[:50] == docs[r.request_id.rsplit("-q", 1)[0]] for r in reqs)
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": 0, "input_length": 1500, "output_length": 40, "hash_ids": [0, 1, 2]},
             {"timestamp": 5, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]},
             {"timestamp": 9, "input_length": 700, "output_length": 3, "hash_ids": [7, 8]}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    spec = WorkloadSpec("mooncake", num_requests=3, max_tokens=8, trace=str(trace),
                        block_tokens=32, max_prompt_tokens=80)
    a, b, c = build_workload(spec, 0)
    assert [len(a.prompt), len(b.prompt), len(c.prompt)] == [80, 64, 44]
    assert [a.max_tokens, b.max_tokens, c.max_tokens] == [8, 2, 3]
    assert a.prompt[:64] == b.prompt and a.prompt[:32] != c.prompt[:32]
    assert all(RESERVED_IDS <= t < 49152 for t in a.prompt + c.prompt)
    assert not set(build_workload(spec, 1)[0].prompt[:32]) & set(a.prompt[:32])


def test_sharegpt_prompts_share_the_seeded_system_prompt():
    spec = WorkloadSpec("sharegpt", num_requests=4, max_tokens=7, max_prompt_tokens=400,
                        system_prompt_tokens=60)
    reqs = build_workload(spec, 0)
    assert len(reqs) == 4 and all(len(r.prompt) <= 400 for r in reqs)
    assert all(1 <= r.max_tokens <= 7 for r in reqs)
    assert all(0 <= t < 49152 for r in reqs for t in r.prompt)
    assert len({r.prompt[:60] for r in reqs}) == 1  # one system prompt, shared
    assert build_workload(spec, 1)[0].prompt[:60] != reqs[0].prompt[:60]


# --------------------------------------------------------------------------- command line


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_help_and_bad_arguments(capsys):
    code, out, _ = run_cli(["bench", "serve", "--help"], capsys)
    assert code == 0 and out.startswith("usage: tokenlake bench serve")
    for flag in ("--base-url", "--baseline-url", "--launch", "--concurrency", "--rate",
                 "--rounds", "--warmup", "--trace", "--block-tokens"):
        assert flag in out
    for argv in ([], ["--base-url", "http://x", "--launch"], ["--launch", "--rate", "0"],
                 ["--base-url", "http://x", "--workload", "bogus"],
                 ["--launch", "--baseline-url", "http://y"],
                 ["--base-url", "http://x", "--trace", "t.jsonl"],
                 ["--base-url", "http://x", "--workload", "mooncake", "--trace", "missing.jsonl"]):
        code, _, err = run_cli(["bench", "serve", *argv], capsys)
        assert code == 2, argv
        assert err.startswith("tokenlake: error: ") and len(err.splitlines()) == 1, err


def test_cli_json_against_a_pool_and_a_baseline(serve_stub, capsys):
    pool, base = serve_stub(Stub()), serve_stub(Stub())
    code, out, err = run_cli(["bench", "serve", "--base-url", pool, "--baseline-url", base,
                              "--num-requests", "6", "--doc-tokens", "40", "--max-tokens", "3",
                              "--concurrency", "2", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert set(result["ratios"]) >= {"ttft_p50", "tbt_p50", "e2e_p50", "throughput_rps",
                                     "output_tokens_per_s"}
    for side in ("pool", "baseline"):
        r = result[side]
        assert set(r) >= {"requests", "errors", "duration_s", "throughput_rps",
                          "output_tokens_per_s", "ttft_ms", "tbt_ms", "e2e_ms", "hit_rate"}
        assert (r["requests"], r["errors"], r["output_tokens"]) == (6, 0, 18)
    assert result["config"]["concurrency"] == 2


# --------------------------------------------------------------------------- --launch


def test_ready_lines_are_read_from_serve_output():
    assert parse_ready_line('{"event": "starting"}') is None
    assert parse_ready_line("some log text") is None
    assert parse_ready_line('{"event": "ready", "http_url": "http://127.0.0.1:8000/"}') \
        == "http://127.0.0.1:8000"
    with pytest.raises(RuntimeError, match="http_url"):
        parse_ready_line('{"event": "ready", "address": "tcp://127.0.0.1:5"}')
    cmd = serve_command("reference", 3, ["--pool-mb", "8"])
    assert cmd[:4] == [sys.executable, "-m", "tokenlake.tools.cli", "serve"]
    joined = " ".join(cmd)
    assert "--engine reference" in joined and "--instances 3" in joined
    assert "--http-port 0" in joined and "--json" in joined and joined.endswith("--pool-mb 8")


STAND_IN = """
import json, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
print(json.dumps({"event": "starting"}), flush=True)
print("not json", flush=True)
print(json.dumps({"event": "ready", "http_url": "http://127.0.0.1:1"}), flush=True)
signal.sigwait([signal.SIGTERM])
print(json.dumps({"event": "stopped"}), flush=True)
"""


def test_launched_server_is_read_until_ready_and_stopped_by_sigterm():
    with ExitStack() as stack:
        server = LaunchedServer([sys.executable, "-c", STAND_IN], "stand-in")
        stack.callback(server.stop)
        server.start()
        assert server.wait_ready(60) == "http://127.0.0.1:1"
        assert server.stop() == 0  # ended by its SIGTERM handling, not killed
    failing = LaunchedServer([sys.executable, "-c", "import sys; sys.exit('no engine')"], "bad")
    failing.start()
    try:
        with pytest.raises(RuntimeError, match="no engine"):
            failing.wait_ready(60)
    finally:
        failing.stop()
    assert failing.proc.returncode == 1

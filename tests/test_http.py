"""The OpenAI-compatible HTTP API of a served pool, driven by the official ``openai``
client and by raw HTTP: answers equal the reference engine's, streams, metrics, a
cancelled stream or a non-streamed client that hangs up frees its request at once, bad
input gets 4xx and changes nothing, a request failing in sampling fails alone (the
front door's limits, on a model-free backend: ``tests/test_http_limits.py``). The model is
the small Llama of ``tests/tiny_model.py``: the claims are the service's, not the model's."""

from __future__ import annotations

import collections
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tokenlake.deploy.local import LocalCluster
from tokenlake.service.serve import SERVED_MODEL, pool_service, reference_service

C = 16
DOC = ("The river Lumen runs 212 kilometres from the Grey Hills to the sea at Kestrel Bay. "
       "Its delta holds three towns: Arden, Mirefield and Salt Reach. ") * 3


@pytest.fixture(scope="module")
def model(tiny_llama):
    """A small Llama with the shipped tokenizer and its reference engine (conftest's
    ``tiny_llama``): what is checked here is the service, not the model's compute."""
    return tiny_llama


@pytest.fixture(scope="module")
def served(model):
    weights, tok, _ = model
    spec = weights.config.to_model_spec(SERVED_MODEL)
    with LocalCluster(2, spec, 32 << 20, segment_tokens=C, max_rows=512) as cluster, \
            pool_service(cluster, control_port=0, http_port=0, model=(weights, tok),
                         chunk_tokens=128) as svc:
        yield svc


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=served.http.url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def _reference_text(model, prompt_ids, max_tokens) -> tuple[str, int]:
    _, tok, ref = model
    out = ref.generate(list(prompt_ids), max_tokens, stop_ids=(tok.eos_id,))
    return tok.decode(out.output_ids, skip_special_tokens=True), len(out.output_ids)


def _chat(question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer in a few words."},
            {"role": "user", "content": f"{DOC}\n{question}"}]


def _metrics(served) -> dict[tuple[str, tuple], float]:
    text = httpx.get(served.http.url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list()] == [SERVED_MODEL]
    assert httpx.get(served.http.url + "/health").json() == {"status": "ok"}
    missing = httpx.get(served.http.url + "/v1/engines")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"


def test_chat_greedy_equals_reference_and_reuses_the_document(model, served, client):
    _, tok, _ = model
    before = _metrics(served)
    answers = []
    for q in ("How long is the river Lumen?", "Name the towns of its delta."):
        msgs = _chat(q)
        r = client.chat.completions.create(model=SERVED_MODEL, messages=msgs, max_tokens=12,
                                           temperature=0)
        want, n = _reference_text(model, tok.apply_chat_template(msgs), 12)
        assert r.choices[0].message.content == want
        assert r.usage.completion_tokens == n
        assert r.choices[0].finish_reason == ("stop" if n < 12 else "length")
        answers.append(r)
    cached = answers[1].usage.prompt_tokens_details.cached_tokens
    assert cached >= C and cached % C == 0, "the second question reuses the shared document"
    after = _metrics(served)
    hit = ("tokenlake_hit_tokens_total", ())
    gen = ("tokenlake_generated_tokens_total", ())
    assert after[hit] - before[hit] == sum(a.usage.prompt_tokens_details.cached_tokens
                                           for a in answers)
    assert after[gen] - before[gen] == sum(a.usage.completion_tokens for a in answers)
    assert after[("tokenlake_ttft_seconds_count", ())] - before[("tokenlake_ttft_seconds_count", ())] == 2
    assert after[("tokenlake_query_latency_seconds_count", ())] > 0
    # the scheduler's split: every iteration gave its phases instances (one request at a
    # time: a prefill iteration or more each, a decode iteration per token after the first)
    runs = {phase: after[("tokenlake_phase_instance_iterations_total", (("phase", phase),))]
            - before[("tokenlake_phase_instance_iterations_total", (("phase", phase),))]
            for phase in ("prefill", "decode")}
    assert runs["prefill"] >= 2 and runs["decode"] >= sum(a.usage.completion_tokens - 1 for a in answers)
    assert ("tokenlake_phase_instances", (("phase", "decode"),)) in after
    assert after[("tokenlake_instance_up", (("instance", "0"),))] == 1
    assert after[("tokenlake_slots_used", (("instance", "0"),))] + \
        after[("tokenlake_slots_used", (("instance", "1"),))] > 0, "the document is stored"


def test_streaming_equals_non_streaming_and_token_prompts_work(model, served, client):
    _, tok, _ = model
    msgs = _chat("Where does the river end?")
    whole = client.chat.completions.create(model=SERVED_MODEL, messages=msgs, max_tokens=10,
                                           temperature=0)
    stream = client.chat.completions.create(model=SERVED_MODEL, messages=msgs, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    ids = tok.apply_chat_template(msgs)  # the same prompt as token ids, on /v1/completions
    comp = client.completions.create(model=SERVED_MODEL, prompt=ids, max_tokens=10,
                                     temperature=0)
    assert comp.choices[0].text == whole.choices[0].message.content


def test_sampling_is_reproducible_with_a_seed(served, client, smollm2):
    kw = dict(model=SERVED_MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.9,
              top_p=0.9)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    assert a == b
    # The test model's logits are too sharp to draw anything but its top token
    # (tests/tiny_model.py); that different seeds draw differently is shown on SmolLM2,
    # served by the reference baseline (the same sampler).
    weights, tok, _ = smollm2
    with reference_service((weights, tok), http_port=0) as ref, \
            openai.OpenAI(base_url=ref.http.url + "/v1", api_key="unused", max_retries=0) as rc:
        same = {rc.completions.create(seed=7, **kw).choices[0].text for _ in range(2)}
        texts = {rc.completions.create(seed=s, **kw).choices[0].text for s in range(1, 5)}
    assert len(same) == 1
    assert len(texts) > 1, "different seeds draw different continuations"


def test_stop_string_cuts_the_answer(model, served, client):
    full = client.completions.create(model=SERVED_MODEL, prompt="One, two, three, four,",
                                     max_tokens=12, temperature=0).choices[0].text
    stop = full.strip()[2:5]
    assert stop and stop in full
    cut = client.completions.create(model=SERVED_MODEL, prompt="One, two, three, four,",
                                    max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def _live(served) -> tuple[tuple[str, ...], int]:
    cp = served.control.shared_control()
    return cp.live_requests, cp.stats().pool.private_slots


def _hold_after(server, monkeypatch, tokens: int) -> threading.Event:
    """Holds ``server``'s compute engine, once a request in its iteration has emitted
    ``tokens`` tokens (sent to its client: an iteration's own token goes out after it),
    until the returned event is set (or a minute passes): a request that is to be seen
    live, or cancelled, is then still running whatever the machine's load (a tiny model
    decodes 400 tokens in about a second)."""
    run, gate = server.engine.run, threading.Event()
    gate.holding = threading.Event()  # set once an iteration is held

    def held(plans, batches):
        out = run(plans, batches)
        if any(len(getattr(server.results.get(rid), "output_ids", ())) >= tokens for rid in out.logits):
            gate.holding.set()
            gate.wait(60)
        return out

    monkeypatch.setattr(server.engine, "run", held)
    return gate


def _results(server) -> dict:
    """What each of ``server``'s requests has come to (for a failed assertion's message)."""
    return {rid: (len(r.output_ids), r.finish_reason, getattr(r, "error", None)) for rid, r in server.results.items()}


def test_cancelled_stream_frees_its_request_within_a_second(served, monkeypatch):
    """A client that leaves mid-stream: its request, live while it streamed, holds nothing
    a second later (the engine is held once it has sent three tokens, until the client
    has looked and left: ``_hold_after``)."""
    gate = _hold_after(served.http.loop.server, monkeypatch, 3)
    aborted = _metrics(served).get(("tokenlake_requests_total", (("outcome", "abort"),)), 0)
    body = {"model": SERVED_MODEL, "prompt": DOC + " Tell me a long story.", "max_tokens": 400,
            "temperature": 0, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", served.http.url + "/v1/completions", json=body,
                          timeout=60) as r:
            assert r.status_code == 200
            chunks, lines = [], r.iter_lines()  # (kept: a generator dropped mid-way closes the stream)
            for line in lines:
                if line.startswith("data:"):
                    chunks.append(json.loads(line.removeprefix("data:")))
                if len(chunks) == 3:  # three tokens out: leave mid-stream (once looked at)
                    break
            # Three token chunks, not an error and [DONE] (an ended request holds nothing).
            assert all(c.get("choices") and c["choices"][0]["finish_reason"] is None
                       for c in chunks), chunks
            server = served.http.loop.server
            assert gate.holding.wait(60), ("the engine was never held", _results(server))
            live = _live(served)
            assert live[0], ("the request holds the pool while it streams", live,
                             "recoveries", served.http.loop.recoveries, _results(server))
    finally:
        gate.set()
    closed = time.monotonic()  # the client went away mid-stream
    while _live(served) != ((), 0):
        assert time.monotonic() - closed < 1.0, f"still held: {_live(served)}"
        time.sleep(0.01)
    assert _aborts_after(served, aborted) == aborted + 1, "cancelled once, not run to its end"


def _aborts_after(served, before: float) -> float:
    """The requests counted as aborted, once more than ``before`` are (within 10 s)."""
    deadline = time.monotonic() + 10
    while (n := _metrics(served).get(("tokenlake_requests_total", (("outcome", "abort"),)), 0)) <= before:
        assert time.monotonic() < deadline, "no request was counted as aborted"
        time.sleep(0.01)
    return n


def test_a_non_streamed_client_that_hangs_up_frees_its_request_within_a_second(served, monkeypatch):
    """The issue's 899 of 900: a non-streamed request whose client goes away is cancelled
    (its handler saw the disconnect but waited for tokens that never came)."""
    body = json.dumps({"model": SERVED_MODEL, "prompt": DOC + " Tell me a long story.",
                       "max_tokens": 400, "temperature": 0, "ignore_eos": True}).encode()
    u = urlsplit(served.http.url)
    in_flight = served.http.metrics.in_flight
    gate = _hold_after(served.http.loop.server, monkeypatch, 1)
    aborted = _metrics(served).get(("tokenlake_requests_total", (("outcome", "abort"),)), 0)
    try:
        with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 60
            while not served.http.loop.server.results or not _live(served)[0]:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.01)
    finally:
        gate.set()
    closed = time.monotonic()
    while _live(served) != ((), 0) or in_flight._value.get():
        assert time.monotonic() - closed < 1.0, (_live(served), in_flight._value.get())
        time.sleep(0.01)
    assert _aborts_after(served, aborted) == aborted + 1, "cancelled once, not run to its end"


def test_a_request_that_fails_in_sampling_fails_alone(model, served, monkeypatch):
    """NaN logits for one request (injected into the compute engine's output) in
    iterations it shares with a streaming greedy request: that request alone ends, with a
    500 body (an error chunk when it streams); the greedy request's answer is the
    reference's; a temperature of 1e-40 is served as greedy (it used to fail the whole
    iteration); /health answers meanwhile; the pool holds nothing afterwards."""
    from test_http_limits import Window  # tests/ is on the path (conftest)

    _, tok, ref = model
    server, loop = served.http.loop.server, served.http.loop
    poison = (7, 7, 7, 7, 7, 7)  # a prompt starting so gets NaN logits
    run = server.engine.run
    long = 256  # tokens: still streaming while the failing requests come and go
    failures_over, greedy_tokens = threading.Event(), collections.Counter()

    def poisoned(plans, batches):
        out = run(plans, batches)
        for rid, logits in out.logits.items():
            if server.tracker[rid].req.prompt_ids[:len(poison)] == poison:
                out.logits[rid] = torch.full_like(logits, float("nan"))
            elif server.tracker[rid].req.max_new_tokens == long:
                greedy_tokens[rid] += 1
        # The greedy request alone, near its end: held until the failures are over, or
        # until a request is posted (it is admitted between iterations), so it overlaps
        # them however slowly this test's thread runs.
        if len(out.logits) == 1 and max(greedy_tokens.values(), default=0) >= long - 32:
            deadline = time.monotonic() + 120
            while not failures_over.is_set() and not loop.posted and time.monotonic() < deadline:
                failures_over.wait(0.005)
        return out

    monkeypatch.setattr(server.engine, "run", poisoned)
    long_prompt = DOC + " Tell me a long story."
    want = tok.decode(ref.generate(tok.encode(long_prompt), long, stop_ids=()).output_ids,
                      skip_special_tokens=True)
    count = "One, two, three, four,"
    count_want, _ = _reference_text(model, tok.encode(count), 6)
    url = served.http.url + "/v1/completions"
    body = {"model": SERVED_MODEL, "prompt": long_prompt, "max_tokens": long, "temperature": 0,
            "stream": True, "ignore_eos": True}
    text, first, done = [], threading.Event(), threading.Event()

    def innocent():
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    text.append(json.loads(line[5:])["choices"][0]["text"])
                    first.set()
        done.set()

    thread = threading.Thread(target=innocent)
    thread.start()
    try:
        assert first.wait(120)
        bad = {"model": SERVED_MODEL, "prompt": list(poison) + [42, 43], "max_tokens": 8}
        with Window(served.http.url) as window:  # /health, probed from another process
            plain = httpx.post(url, json=bad, timeout=120)
            with httpx.stream("POST", url, json={**bad, "stream": True}, timeout=120) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            tiny = httpx.post(url, json={"model": SERVED_MODEL, "prompt": count,
                                         "max_tokens": 6, "temperature": 1e-40}, timeout=120)
        assert not done.is_set(), "the greedy request ended before the failures: no overlap"
    finally:
        failures_over.set()
        thread.join(120)
    window.assert_fast()
    assert plain.status_code == 500, plain.text
    err = plain.json()["error"]
    assert err["type"] == "server_error" and "SamplingError" in err["message"]
    assert events[-1] == "[DONE]" and "SamplingError" in json.loads(events[-2])["error"]["message"]
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == count_want
    assert "".join(text) == want, "the greedy request beside the failing one changed"
    assert _live(served) == ((), 0)
    assert _metrics(served)[("tokenlake_requests_total", (("outcome", "error"),))] >= 2


def test_the_reference_server_ends_a_failing_request_alone(model):
    """The baseline's iterations too: NaN logits for one request of a decode batch end
    that request (``finish_reason == "error"``), the others' tokens are
    ``generate``'s."""
    from tokenlake.generation.reference import ReferenceLoop
    from tokenlake.generation.requests import GenerationRequest

    weights, tok, ref = model
    server = ReferenceLoop(weights, chunk_tokens=64)
    failed = []
    server.on_error = lambda rid, message: failed.append((rid, message))
    decode = server.engine.decode_batch

    def poisoned(caches, tokens):
        logits = decode(caches, tokens)
        bad = server._live.get("bad")
        for i, cache in enumerate(caches):
            if bad is not None and cache is bad.cache and len(bad.result.output_ids) == 2:
                logits[i] = float("nan")  # its third token
        return logits

    server.engine.decode_batch = poisoned
    prompts = {rid: tuple(tok.encode(f"Count from {n}:")) for rid, n in
               (("a", 1), ("bad", 5), ("b", 9))}
    for rid, p in prompts.items():
        server.submit(GenerationRequest(rid, p, 6, ()))
    while server.busy:
        server.step()
    assert server.results["bad"].finish_reason == "error"
    assert server.results["bad"].output_ids == ref.generate(list(prompts["bad"]), 2, ()).output_ids
    assert failed == [("bad", server.results["bad"].error)] and "SamplingError" in failed[0][1]
    for rid in ("a", "b"):
        assert server.results[rid].output_ids == ref.generate(list(prompts[rid]), 6, ()).output_ids


def test_concurrent_requests_are_batched(model, served, monkeypatch):
    server, loop = served.http.loop.server, served.http.loop
    seen = len(server.decisions)
    results = {}
    run, first = server.engine.run, threading.Event()

    def together(plans, batches):
        """The first iteration ends once all three requests are live or posted (each
        thread makes its own HTTP client: they arrive tens of milliseconds apart), so the
        next admits the others beside the first."""
        out = run(plans, batches)
        deadline = time.monotonic() + 60
        while not first.is_set() and len(server.tracker) + loop.posted < 3 and time.monotonic() < deadline:
            time.sleep(0.002)
        first.set()
        return out

    monkeypatch.setattr(server.engine, "run", together)

    def ask(i: int) -> None:
        body = {"model": SERVED_MODEL, "prompt": f"Count to ten in language {i}:",
                "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        results[i] = httpx.post(served.http.url + "/v1/completions", json=body, timeout=120)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in results.values())
    decisions = list(server.decisions)[seen - len(server.decisions):] if seen else list(server.decisions)
    widest = max(len(b.request_ids) for d in decisions for b in d.batches)
    assert widest >= 2, "requests that are live together share iterations"


BAD = [
    ({"model": "nope", "prompt": "hi"}, 404, "model_not_found"),
    ({"model": SERVED_MODEL, "prompt": "hi", "max_tokens": 0}, 400, None),
    ({"model": SERVED_MODEL, "prompt": "hi", "max_tokens": "many"}, 400, None),
    ({"model": SERVED_MODEL, "prompt": [1, 2, 10**9]}, 400, None),
    ({"model": SERVED_MODEL, "prompt": [7] * 8000, "max_tokens": 500}, 400,
     "context_length_exceeded"),
    ({"model": SERVED_MODEL, "prompt": "hi", "temperature": -1}, 400, None),
    ({"model": SERVED_MODEL, "prompt": "hi", "n": 3}, 400, None),
    ({"prompt": "hi"}, 400, None),
]


@pytest.mark.parametrize("body,status,code", BAD)
def test_bad_input_gets_an_openai_error_and_changes_nothing(served, body, status, code):
    before = _live(served)
    r = httpx.post(served.http.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if code:
        assert err["code"] == code
    assert _live(served) == before == ((), 0)


def test_malformed_json_and_the_server_keeps_serving(served, client):
    r = httpx.post(served.http.url + "/v1/chat/completions", content=b'{"model": ',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    ok = client.completions.create(model=SERVED_MODEL, prompt="Hello", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_pool_too_small_for_a_request_is_refused(model):
    weights, tok, _ = model
    spec = weights.config.to_model_spec(SERVED_MODEL)
    with LocalCluster(1, spec, 2 << 20, segment_tokens=C, max_rows=256) as cluster, \
            pool_service(cluster, control_port=0, http_port=0, model=(weights, tok)) as svc:
        room = svc.http.app  # the limit is computed from the pool's slots
        body = {"model": SERVED_MODEL, "prompt": [5] * 1500, "max_tokens": 10}
        r = httpx.post(svc.http.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert "pool" in r.json()["error"]["message"] and room is not None


def test_an_engine_per_instance_serves_the_same_answers_splitting_prefills(model):
    """``compute="per-instance"`` (``tokenlake serve --compute per-instance``): one compute
    engine per instance, the goodput DP free to split a prefill over both instances;
    the answers equal the reference engine's."""
    from tokenlake.engines.compute import ParallelComputeEngine

    weights, tok, _ = model
    spec = weights.config.to_model_spec(SERVED_MODEL)
    with LocalCluster(2, spec, 32 << 20, segment_tokens=C, max_rows=512) as cluster, \
            pool_service(cluster, control_port=0, http_port=0, model=(weights, tok),
                         chunk_tokens=128, compute="per-instance") as svc, \
            openai.OpenAI(base_url=svc.http.url + "/v1", api_key="unused", max_retries=0,
                          timeout=120) as c:
        server = svc.http.loop.server
        assert isinstance(server.engine, ParallelComputeEngine) and server.compute_slots == 2
        for q in ("How long is the river Lumen?", "Name the towns of its delta."):
            msgs = _chat(q)
            r = c.chat.completions.create(model=SERVED_MODEL, messages=msgs, max_tokens=8,
                                          temperature=0)
            assert r.choices[0].message.content == _reference_text(
                model, tok.apply_chat_template(msgs), 8)[0]
        assert any(b.phase == "prefill" and b.dop == 2 for d in server.decisions for b in d.batches)
    with pytest.raises(ValueError, match="per-instance"):
        with LocalCluster(1, spec, 8 << 20, segment_tokens=C, max_rows=256) as cluster, \
                pool_service(cluster, control_port=0, http_port=0, model=(weights, tok),
                             compute="each"):
            pass


def test_the_reference_baseline_answers_the_same(model, client):
    weights, tok, _ = model
    msgs = _chat("How long is the river Lumen?")
    pooled = client.chat.completions.create(model=SERVED_MODEL, messages=msgs, max_tokens=8,
                                            temperature=0)
    with reference_service((weights, tok), http_port=0) as ref, \
            openai.OpenAI(base_url=ref.http.url + "/v1", api_key="unused", max_retries=0) as rc:
        plain = rc.chat.completions.create(model=SERVED_MODEL, messages=msgs, max_tokens=8,
                                           temperature=0)
        assert plain.choices[0].message.content == pooled.choices[0].message.content
        assert plain.usage.prompt_tokens_details.cached_tokens == 0
        assert ref.control is None


def test_reference_server_batches_and_equals_generate(model):
    """The baseline batches decode and packs prefill chunks; its greedy tokens are the
    reference engine's, request by request."""
    from tokenlake.generation.reference import ReferenceLoop
    from tokenlake.generation.requests import GenerationRequest

    weights, tok, ref = model
    server = ReferenceLoop(weights, chunk_tokens=40)
    prompts = {f"r{i}": tuple(tok.apply_chat_template(_chat(q))) for i, q in
               enumerate(("How long?", "Which towns?", "Where is the sea?"))}
    for rid, p in prompts.items():
        server.submit(GenerationRequest(rid, p, 5, (tok.eos_id,)))
    widest = 0
    while server.busy:
        widest = max(widest, server.counts()[1])
        server.step()
    assert widest >= 2
    for rid, p in prompts.items():
        assert server.results[rid].output_ids == ref.generate(list(p), 5).output_ids


def test_a_dead_engine_is_replaced_and_serving_goes_on(model, monkeypatch):
    """Engines die under the served pool, while idle and in the middle of a stream: the
    watcher sees each death at once, the instances are replaced (empty) between
    iterations, the streaming request computes what it lost again, and every answer,
    the interrupted one included, equals the reference's."""
    weights, tok, _ = model
    spec = weights.config.to_model_spec(SERVED_MODEL)
    msgs = _chat("Which towns are in the delta?")
    want, _ = _reference_text(model, tok.apply_chat_template(msgs), 6)
    body = {"model": SERVED_MODEL, "messages": msgs, "max_tokens": 6, "temperature": 0}
    long_prompt = DOC + " Tell me a long story."
    ref_ids = model[2].generate(tok.encode(long_prompt), 24, stop_ids=()).output_ids
    long_want = tok.decode(ref_ids, skip_special_tokens=True)
    with LocalCluster(2, spec, 32 << 20, segment_tokens=C, max_rows=512) as cluster, \
            pool_service(cluster, control_port=0, http_port=0, model=(weights, tok)) as svc:
        url = svc.http.url + "/v1/chat/completions"
        assert httpx.post(url, json=body, timeout=120).json()["choices"][0]["message"][
            "content"] == want
        seen = threading.Event()
        cluster.add_failure_listener(lambda role, instance: seen.set())
        old = {key: cluster._procs[key].pid for key in (("query", 0), ("transfer", 1))}
        killed = time.monotonic()
        for role, instance in old:  # every iteration needs one of these two
            cluster.kill(role, instance)
        assert seen.wait(2.0), "the watcher saw no death within 2 s"
        assert time.monotonic() - killed < 2.0
        # the engine thread replaces the instances before it takes the next request
        again = httpx.post(url, json=body, timeout=120).json()
        assert again["choices"][0]["message"]["content"] == want
        for key, pid in old.items():
            assert cluster.alive(*key) and cluster._procs[key].pid != pid
        assert svc.http.loop.recoveries >= 1

        # mid-stream: the request's KV is lost with its instance and computed again
        stream_body = {"model": SERVED_MODEL, "prompt": long_prompt, "max_tokens": 24,
                       "temperature": 0, "stream": True, "ignore_eos": True}
        text, got = [], 0
        gate = _hold_after(svc.http.loop.server, monkeypatch, 4)  # still running at the kills
        try:
            with httpx.stream("POST", svc.http.url + "/v1/completions", json=stream_body,
                              timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    text.append(json.loads(line[5:])["choices"][0]["text"])
                    got += 1
                    if got == 4:  # four tokens out: both instances lose an engine
                        cluster.kill("query", 1)
                        cluster.kill("transfer", 0)
                        gate.set()
        finally:
            gate.set()
        assert "".join(text) == long_want
        assert cluster.alive("query", 1) and cluster.alive("transfer", 0)
        assert svc.http.loop.recoveries >= 2

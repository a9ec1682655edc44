"""The HTTP front door under hostile input (issue #39, finding 3): every abusive request
gets its 4xx (or its own 500) with an OpenAI error body, ``/health`` answers within
100 ms while the abuse is in progress, and an innocent request streaming meanwhile gets
exactly the answer it gets alone.

The backend is model-free (:class:`Paced`: one token per live request per step, each
request's tokens a function of its prompt), behind the real HTTP stack (uvicorn on a
free port, the real SmolLM2 tokenizer); ``/health`` is probed from another process
(``tests/health_probe.py``), so that a server holding the GIL cannot hide its stall.
The real model's share (a request failing in sampling beside greedy ones) is in
``tests/test_http.py``.
"""

from __future__ import annotations

import gc
import http.client
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenlake.generation.requests import RequestResult
from tokenlake.service.frontend import HttpFrontend
from tokenlake.service.http import ModelInfo
from tokenlake.service.limits import HttpLimits, longest_token_bytes
from tokenlake.service.serve import SERVED_MODEL

POISON = 4242  # a token-id prompt starting with it gets a token the tokenizer does not know
HEALTH_S = 0.100  # the bound on /health, for the median of the probes in a window
PROBE_S = 0.02  # health_probe.py's interval between probes
QUIET_S = 0.4  # the idle window each Window measures first: what /health costs here now
SLOWER = 3.0  # a loaded machine may answer this much slower than its own quiet window
INNOCENT = {"model": SERVED_MODEL, "prompt": "The river Lumen runs to the sea.",
            "max_tokens": 200, "temperature": 0, "stream": True}


class Paced:
    """A serving backend with no model: every step (``step_s`` of simulated compute)
    gives each live request its next token, ``1000 + (31 * sum(prompt[:8]) + 997 * i) %
    20000``, so a request's answer is fixed whatever is served beside it. A prompt that
    starts with :data:`POISON` gets token ``vocab + 7`` second."""

    def __init__(self, vocab: int, step_s: float = 0.002) -> None:
        self.on_token = self.on_error = None
        self.results: dict[str, RequestResult] = {}
        self.live: dict = {}
        self.vocab, self.step_s = vocab, step_s

    @property
    def busy(self) -> bool:
        return bool(self.live)

    def counts(self) -> tuple[int, int]:
        return 0, len(self.live)

    def submit(self, req):
        self.results[req.request_id] = res = RequestResult(req.request_id, req.prompt_ids)
        self.live[req.request_id] = req
        return res

    def step(self) -> None:
        time.sleep(self.step_s)  # the model's compute
        for rid, req in list(self.live.items()):
            res = self.results[rid]
            i = len(res.output_ids)
            token = (self.vocab + 7 if req.prompt_ids[0] == POISON and i == 1 else
                     1000 + (31 * sum(req.prompt_ids[:8]) + 997 * i) % 20000)
            res.output_ids.append(token)
            if len(res.output_ids) >= req.max_new_tokens:
                res.done, res.finish_reason = True, "length"
                del self.live[rid]
            self.on_token(rid, token)

    def cancel(self, rid: str) -> bool:
        if self.live.pop(rid, None) is None:
            return False
        self.results[rid].done, self.results[rid].finish_reason = True, "abort"
        return True

    def pop_result(self, rid: str):
        res = self.results.get(rid)
        return self.results.pop(rid) if res is not None and res.done else None


@pytest.fixture(scope="module")
def tok():
    from tokenlake.model.llama.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def front(tok):
    info = ModelInfo(SERVED_MODEL, tok, 8192, tok.vocab_size)
    with HttpFrontend(Paced(tok.vocab_size), info, port=0,
                      limits=HttpLimits(body_timeout_s=1.0)) as http_front:
        yield http_front


@pytest.fixture(scope="module")
def expected(front):
    """The innocent request's answer, served alone."""
    return _stream_text(front.url, INNOCENT)


def _stream_text(url: str, body: dict) -> str:
    parts = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                parts.append(chunk["choices"][0]["text"])
    return "".join(parts)


class Innocent:
    """The innocent request, streaming on a thread: entering waits for its first token
    (so the abuse that follows overlaps it), :meth:`text` its whole answer."""

    def __init__(self, url: str) -> None:
        self.url, self.parts, self.first = url, [], threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=INNOCENT,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.parts.append(json.loads(line[6:])["choices"][0]["text"])
                        self.first.set()
        except BaseException as e:  # the test thread reports it
            self.error = e
        finally:
            self.first.set()

    def __enter__(self) -> Innocent:
        self.thread.start()
        assert self.first.wait(30) and self.error is None, self.error
        return self

    def __exit__(self, *exc) -> None:
        self.thread.join(60)

    def text(self) -> str:
        self.thread.join(60)
        assert self.error is None, self.error
        return "".join(self.parts)


class Window:
    """``/health`` probed from another process while the ``with`` block runs; after it,
    :attr:`latencies` are those of the probes sent inside the block.

    The server runs in this process, beside pytest, torch and every earlier test's
    objects: a full garbage collection of that heap takes 150 ms or more here and stops
    every thread. The block runs with the objects that existed before it frozen
    (``gc.freeze``: the collector skips them), so what it measures is the server's own
    work; what the block allocates is collected as usual."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []

    def __enter__(self) -> Window:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("health_probe.py")), self.url],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        gc.collect()
        gc.freeze()
        self.quiet_start = time.monotonic()
        time.sleep(QUIET_S)  # the length of the quiet measurement, not a wait for an event
        self.start = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        end = self.end = time.monotonic()
        gc.unfreeze()
        out, _ = self.proc.communicate("stop\n", timeout=60)
        probes = json.loads(out)
        self.quiet = [s for sent, s in probes if self.quiet_start <= sent < self.start]
        self.latencies = [s for sent, s in probes if self.start <= sent <= end]

    def assert_fast(self) -> None:
        lat = sorted(self.latencies)
        # five probes, or as many as a short window (an abuse over quickly) had room for,
        # less two (the probe in flight at each end)
        room = min(5, max(2, int((self.end - self.start) / PROBE_S) - 2))
        assert len(lat) >= room and len(self.quiet) >= 5, \
            f"only {len(lat)} probes in the window of {self.end - self.start:.3f} s, {len(self.quiet)} before it"
        bound = max(HEALTH_S, SLOWER * statistics.median(self.quiet))
        assert statistics.median(lat) < bound, (
            f"/health median {statistics.median(lat) * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms"
            f" (quiet median {statistics.median(self.quiet) * 1e3:.1f} ms)")


def _repeat(fn, min_s: float = 0.3) -> list:
    """``fn()`` at least once, and again until ``min_s`` have passed (an abuse that is
    refused at once is kept up long enough for the probes to see it)."""
    start, out = time.monotonic(), []
    while not out or time.monotonic() - start < min_s:
        out.append(fn())
    return out


def _abused(front, expected, abuse, min_s: float = 0.3) -> list:
    """Runs ``abuse`` (repeatedly for ``min_s``) while the innocent request streams and
    ``/health`` is probed; checks both; returns the abuse's results."""
    with Innocent(front.url) as innocent, Window(front.url) as window:
        results = _repeat(abuse, min_s)
    window.assert_fast()
    assert innocent.text() == expected, "the innocent request's answer changed"
    return results


def _raw(url: str, head: str, body: bytes = b"", timeout: float = 10.0):
    """Sends ``head`` (the request line and headers, no blank line) and ``body`` on a
    fresh connection; returns ``(status, JSON body, whether the server then closed)``."""
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        data = json.loads(resp.read())
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:  # closed with some of what was sent unread
            closed = True
        except TimeoutError:
            closed = False
        return resp.status, data, closed


def _post_head(length: int | None, path: str = "/v1/completions", close: bool = False) -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    lines.append(f"Content-Length: {length}" if length is not None else
                 "Transfer-Encoding: chunked")
    if close:
        lines.append("Connection: close")
    return "\r\n".join(lines)


def _error(data: dict, code: str | None = None) -> dict:
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], data
    if code is not None:
        assert err["code"] == code, data
    return err


def _metric(front, name: str, labels: tuple = ()) -> float:
    text = httpx.get(front.url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}[(name, labels)]


def _quiet(front) -> None:
    """Waits until the loop has no live request and no POST is being answered."""
    deadline = time.monotonic() + 10
    while front.loop.live or _metric(front, "tokenlake_http_in_flight"):
        assert time.monotonic() < deadline, (
            f"still live: {front.loop.live} requests, "
            f"{_metric(front, 'tokenlake_http_in_flight')} POSTs being answered")
        time.sleep(0.01)


# ---------------------------------------------------------------- body size and time


@pytest.mark.parametrize("megabytes", [10, 50])
def test_a_body_over_the_limit_is_refused_before_it_is_read(front, expected, megabytes):
    """The 10 MB and 50 MB prompts of the issue: 413 from the Content-Length alone (no
    byte of the body is sent), and the connection closed."""
    head = _post_head(megabytes * 10**6)
    for status, data, closed in _abused(front, expected, lambda: _raw(front.url, head)):
        assert status == 413 and closed
        assert "at most 4194304" in _error(data, "request_too_large")["message"]


def test_a_chunked_body_is_cut_off_at_the_limit(front, expected):
    """No Content-Length (chunked): the body is read up to the limit (4 MiB) and the
    request refused there, not read to its end."""
    chunk = b"x" * (1 << 16)
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    body = framed * ((4 << 20) // len(chunk) + 1)  # one chunk over the limit, no last chunk

    def send():
        return _raw(front.url, _post_head(None), body)

    for status, data, closed in _abused(front, expected, send):
        assert status == 413 and closed
        _error(data, "request_too_large")


def test_a_body_shorter_than_its_content_length_gets_408(front, expected):
    """A client that announces 1,000 bytes and sends 10 is answered 408 once the body
    timeout (1 s here, 10 s by default) has passed, and disconnected."""
    def send():
        return _raw(front.url, _post_head(1000), b'{"model": ')

    (status, data, closed), = _abused(front, expected, send, min_s=0)
    assert status == 408 and closed
    assert "within 1 s" in _error(data, "request_timeout")["message"]


# ---------------------------------------------------------------- text and numbers


def _body(fields: str, model: str = f'"{SERVED_MODEL}"') -> bytes:
    """A JSON body written out, so that it can spell what ``json.dumps`` would not."""
    return ('{"model": ' + model + ", " + fields + "}").encode()


@pytest.mark.parametrize("body,where", [
    (_body('"prompt": "\\ud800"'), "prompt"),
    (_body('"prompt": ["a\\udfff"]'), "prompt"),
    (_body('"prompt": "hi", "stop": ["\\ud800"]'), "stop"),
    (_body('"prompt": "hi"', model='"\\ud800"'), "model"),
], ids=["prompt", "prompt-list", "stop", "model"])
def test_a_lone_surrogate_gets_400(front, expected, body, where):
    def send():
        return httpx.post(front.url + "/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)

    for r in _abused(front, expected, send):
        assert r.status_code == 400, r.text
        err = _error(r.json())
        assert err["param"] == where and "surrogate" in err["message"]


def test_a_lone_surrogate_in_a_chat_message_gets_400(front, expected):
    body = _body('"messages": [{"role": "user", "content": "\\ud83d"}]')

    def send():
        return httpx.post(front.url + "/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)

    for r in _abused(front, expected, send):
        assert r.status_code == 400, r.text
        err = _error(r.json())
        assert err["param"] == "messages" and "surrogate" in err["message"]


@pytest.mark.parametrize("raw", [b"\xff", b"\xed\xa0\x80", b"\xc3"],
                         ids=["ff", "encoded-surrogate", "truncated"])
def test_a_body_that_is_not_utf8_gets_400(front, expected, raw):
    body = b'{"model": "%s", "prompt": "a%sb"}' % (SERVED_MODEL.encode(), raw)

    def send():
        return _raw(front.url, _post_head(len(body)), body)

    for status, data, closed in _abused(front, expected, send):
        assert status == 400 and closed
        assert "UTF-8" in _error(data, "invalid_encoding")["message"]


@pytest.mark.parametrize("field", [
    {"prompt": [True]}, {"prompt": [5, False]}, {"max_tokens": True}, {"temperature": True},
    {"seed": False}], ids=["prompt", "prompt-2", "max_tokens", "temperature", "seed"])
def test_booleans_are_not_numbers(front, expected, field):
    body = {"model": SERVED_MODEL, "prompt": "hi", **field}

    def send():
        return httpx.post(front.url + "/v1/completions", json=body, timeout=30)

    for r in _abused(front, expected, send):
        assert r.status_code == 400, r.text
        err = _error(r.json())
        assert err["param"] == next(iter(field)) and "not true or false" in err["message"]


# ---------------------------------------------------------------- prompts and stops


def _words(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)  # fresh words each time: no tokenizer cache helps
    out, n = [], 0
    while n < chars:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def test_a_prompt_too_long_for_the_limit_is_refused_before_tokenizing(front, expected, tok):
    """More characters than 8192 tokens can hold (8192 x the longest token, 81 bytes):
    refused as it is; just under that bound: tokenized on a worker thread while /health
    answers (the tokenizer releases the GIL), then refused by its exact count."""
    bound = 8192 * longest_token_bytes(tok, tok.vocab_size)
    over = {"model": SERVED_MODEL, "prompt": "a" * (bound + 1), "max_tokens": 1}

    def send_over():
        return httpx.post(front.url + "/v1/completions", json=over, timeout=30)

    for r in _abused(front, expected, send_over):
        assert r.status_code == 400
        err = _error(r.json(), "context_length_exceeded")
        assert f"{bound + 1} characters" in err["message"] and err["param"] == "prompt"

    under = {"model": SERVED_MODEL, "prompt": _words(bound - 1), "max_tokens": 1}

    def send_under():  # about 0.4 s of tokenizing on one core
        return httpx.post(front.url + "/v1/completions", json=under, timeout=60)

    for r in _abused(front, expected, send_under, min_s=0):
        assert r.status_code == 400
        err = _error(r.json(), "context_length_exceeded")
        assert "tokens; at most 8192 prompt tokens" in err["message"]


def test_long_stop_strings_are_refused_and_the_longest_allowed_cost_little(front, expected):
    """The issue's four 200,000-character stops: 400. Four of 1,000 characters (the
    limit), each the answer's first 999 characters and one it never holds, so every
    token extends a partial match: the answer is unchanged and /health stays fast."""
    huge = {**INNOCENT, "stream": False, "stop": ["ab" * 100_000] * 4}

    def send_huge():
        return httpx.post(front.url + "/v1/completions", json=huge, timeout=30)

    for r in _abused(front, expected, send_huge):
        assert r.status_code == 400
        err = _error(r.json())
        assert err["param"] == "stop" and "at most 1000" in err["message"]

    assert len(expected) > 1000
    stops = [expected[:999] + c for c in "\x00\x01\x02\x03"]
    answers = _abused(front, expected,
                      lambda: _stream_text(front.url, {**INNOCENT, "stop": stops}), min_s=0)
    assert answers == [expected]


# ---------------------------------------------------------------- hang-ups and failures


def test_clients_that_hang_up_cancel_their_requests(front, expected):
    """30 non-streamed and 10 streamed requests whose clients hang up: every request is
    cancelled and every handler ends (the issue: 899 of 900 non-streamed handlers waited
    forever); the abort count grows by 40."""
    aborts = _metric(front, "tokenlake_requests_total", (("outcome", "abort"),))
    u = urlsplit(front.url)

    def hang_up():
        socks = []
        for i in range(40):
            body = json.dumps({"model": SERVED_MODEL, "prompt": f"story {i}",
                               "max_tokens": 4000, "stream": i >= 30}).encode()
            s = socket.create_connection((u.hostname, u.port), timeout=10)
            s.sendall(_post_head(len(body)).encode() + b"\r\n\r\n" + body)
            socks.append(s)
        deadline = time.monotonic() + 10
        while front.loop.live < 40:  # all 40 are generating
            assert time.monotonic() < deadline, front.loop.live
            time.sleep(0.01)
        for s in socks:
            s.close()
        _quiet(front)

    _abused(front, expected, hang_up, min_s=0)
    assert _metric(front, "tokenlake_requests_total", (("outcome", "abort"),)) - aborts == 40


def test_a_request_whose_detokenizing_fails_fails_alone(front, expected):
    """A token the tokenizer does not know: that request gets a 500 body (non-streamed)
    or an error chunk then [DONE] (streamed), and is ended; the others are untouched."""
    body = {"model": SERVED_MODEL, "prompt": [POISON, 5, 6], "max_tokens": 50}

    def send():
        plain = httpx.post(front.url + "/v1/completions", json=body, timeout=30)
        with httpx.stream("POST", front.url + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        return plain, events

    for plain, events in _abused(front, expected, send):
        assert plain.status_code == 500
        err = _error(plain.json())
        assert err["type"] == "server_error" and "could not turn its tokens" in err["message"]
        assert events[-1] == "[DONE]" and "could not turn" in json.loads(events[-2])["error"]["message"]
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    _quiet(front)

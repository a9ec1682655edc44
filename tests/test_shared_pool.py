"""One pool, many clients (issue #39): the HTTP API's serving loop and three compute
engines in other processes (``tokenlake.connect``) use one served pool of two
instances at the same time, with overlapping prompts, and every answer is exact: the
workers' partials equal the float64 reference, the HTTP answers the reference engine's.
Then a fourth client is killed with ``kill -9`` in the middle of an iteration: the
others never fail, and within 5 s its session is ended, its iteration aborted, the
segments it was storing dropped and its request gone; a later client stores the same
document itself and reads it back exactly.

Each session has its own buffers and plan namespace (the workers even name their
requests alike); without that (every client on the instance's own buffers) the first
test fails with wrong partials. The model is the small Llama of ``tests/tiny_model.py``
(its shape is what the workers' synthetic K/V follows): the claims are the pool's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tokenlake.dataplane import credentials
from tokenlake.dataplane.shm_files import cluster_prefix, list_buffers
from tokenlake.deploy.local import LocalCluster
from tokenlake.service.serve import SERVED_MODEL, pool_service

WORKER = Path(__file__).with_name("shared_pool_worker.py")
C = 16
SYSTEM = ("You are a careful assistant. The river Lumen runs 212 kilometres from the Grey "
          "Hills to the sea at Kestrel Bay; its delta holds Arden, Mirefield and Salt Reach.")
QUESTIONS = ("How long is the river Lumen?", "Where does the Lumen reach the sea?",
             "Name one town of the delta.", "Where does the Lumen start?")


@pytest.fixture(scope="module")
def pool(tiny_llama):
    weights, tok, _ = tiny_llama
    spec = weights.config.to_model_spec(SERVED_MODEL)
    with LocalCluster(2, spec, 64 << 20, segment_tokens=C, max_rows=256) as cluster:
        prefix = cluster_prefix(cluster.cluster_id)
        with pool_service(cluster, control_port=0, http_port=0, model=(weights, tok),
                          chunk_tokens=128) as svc:
            path = credentials.write(credentials.default_path(svc.control.address),
                                     svc.control.credentials())
            try:
                yield cluster, svc, spec
            finally:
                credentials.remove(path)
    assert list_buffers(prefix) == [], "a session's buffers outlived the pool"


def start_worker(svc, spec, seed: int, iterations: int, *mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), svc.control.address, json.dumps(dataclasses.asdict(spec)),
         str(seed), str(iterations), *mode],
        cwd=WORKER.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300.0) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def chat(svc, question: str, system: str = SYSTEM) -> tuple[str, list[dict]]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    r = httpx.post(svc.http.url + "/v1/chat/completions", timeout=300, json={
        "model": SERVED_MODEL, "messages": msgs, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], msgs


def reference(tiny_llama, msgs) -> str:
    _, tok, ref = tiny_llama
    out = ref.generate(tok.apply_chat_template(msgs), 8, stop_ids=(tok.eos_id,))
    return tok.decode(out.output_ids, skip_special_tokens=True)


def test_http_and_three_workers_share_a_pool_exactly(pool, tiny_llama):
    cluster, svc, spec = pool
    workers = [start_worker(svc, spec, seed, 34) for seed in (1, 2, 3)]
    answers: list[tuple[str, list[dict]]] = []
    errors: list[BaseException] = []

    def ask(questions) -> None:
        try:
            for q in questions:
                answers.append(chat(svc, q))
        except BaseException as e:  # reported below
            errors.append(e)

    http = [threading.Thread(target=ask, args=(QUESTIONS[i::2],)) for i in range(2)]
    for t in http:
        t.start()
    results = [finish(w) for w in workers]
    for t in http:
        t.join(300)
    assert not errors, errors
    assert sum(r["iterations"] for r in results) >= 100
    assert max(r["worst"] for r in results) < 1e-4, results
    assert len({r["session"] for r in results}) == 3
    assert all(r["bells"] for r in results), results  # their per-layer hand-offs went through their bells
    for text, msgs in answers:  # greedy answers are the reference engine's, token for token
        assert text == reference(tiny_llama, msgs)
    assert len(answers) == len(QUESTIONS)
    live = cluster.control.live_requests
    assert not [r for r in live if "/" in r], live  # every worker's requests finished
    assert len(svc.control.sessions) == 0  # all three closed their sessions
    cluster.control.check()


def test_a_client_killed_mid_iteration_is_cleaned_up_within_5_s(pool):
    cluster, svc, spec = pool
    workers = [start_worker(svc, spec, seed, 12) for seed in (7, 8)]
    victim = start_worker(svc, spec, 99, 1, "victim")
    ready = json.loads(victim.stdout.readline())
    assert ready["ready"] and ready["keys"], ready
    number = ready["session"]
    tree = cluster.control.get_prefix_tree()
    with svc.control.lock:
        assert any(s.number == number and s.iterations for s in svc.control.sessions)
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    victim.wait(10)
    while any(s.number == number for s in svc.control.sessions):  # the server notices
        assert time.monotonic() - killed < 5.0, "the dead client's session is still open"
        time.sleep(0.02)
    ended = time.monotonic() - killed
    with svc.control.lock:
        assert not [r for r in cluster.control.live_requests if r.startswith(f"{number}/")]
        for key in ready["keys"]:  # the segments it had not finished storing are gone
            assert bytes.fromhex(key) not in tree
        cluster.control.check()
    results = [finish(w) for w in workers]  # the others never failed
    assert max(r["worst"] for r in results) < 1e-4, results
    assert ended < 5.0
    metrics = httpx.get(svc.http.url + "/metrics", timeout=30).text
    assert "tokenlake_sessions_ended_total 1.0" in metrics, [
        line for line in metrics.splitlines() if "session" in line]
    # whoever needs the dropped document computes it: it is stored and read back exactly
    again = finish(start_worker(svc, spec, 99, 1, "reuse"))
    assert again["first_hit"] == 0 and again["hit"] == 48 and again["worst"] < 1e-4, again


def test_a_request_waits_for_a_segment_another_client_stores_and_computes_it_when_that_client_dies(pool, tiny_llama):
    """A worker is storing (synthetic K/V for) the first segments of a chat prompt when
    the same prompt arrives over HTTP: the serving loop does not fail the request, it
    waits (the segments are not visible). The worker is killed: its session is ended,
    its unfinished segments dropped, and the request stores them itself; its answer is
    the reference engine's, so nothing of the dead client's K/V was ever read."""
    cluster, svc, spec = pool
    _, tok, _ = tiny_llama
    # a system prompt of its own: no earlier test of the module has its segments cached
    msgs = [{"role": "system", "content": "You answer in one short sentence. " + SYSTEM},
            {"role": "user", "content": "Which towns are in the delta of the Lumen?"}]
    prompt = tok.apply_chat_template(msgs)
    assert cluster.control.get_prefix_tree().match(prompt).hit_tokens == 0
    victim = start_worker(svc, spec, 5, 1, "victim", json.dumps(prompt[: 3 * C]))
    ready = json.loads(victim.stdout.readline())
    assert ready["ready"] and len(ready["keys"]) == 3, ready  # it stores all three segments
    server = svc.http.loop.server
    waits = server.waits_in_flight
    answer: list = []
    asked = threading.Thread(target=lambda: answer.append(chat(svc, msgs[1]["content"], msgs[0]["content"])))
    asked.start()
    deadline = time.monotonic() + 60
    while server.waits_in_flight == waits:  # the request is held back, not failed
        assert time.monotonic() < deadline and asked.is_alive(), answer
        time.sleep(0.02)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    asked.join(120)
    assert answer, "the request never finished"
    text, sent = answer[0]
    assert text == reference(tiny_llama, sent)
    for key in ready["keys"]:  # stored again by the request itself, ready now
        assert cluster.control.get_prefix_tree().is_ready(bytes.fromhex(key))

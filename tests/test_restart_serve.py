"""`tokenlake serve` killed with `kill -9` and started again, as an operator would
(docs/design.md §4 "Restart"): with the same settings and ports it adopts the waiting
engines and the next question about a cached document hits what it hit before and
answers the same text; with another segment size it refuses (exit 2, one line) and the
old engines end after their grace with every buffer and file. Stopped cleanly and
started again on its disk tier, it finds the document there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tokenlake.dataplane import pool_state
from tokenlake.dataplane.shm_files import cluster_prefix, list_buffers, pid_alive
from tokenlake.tools.bench.restart import free_ports

START_TIMEOUT_S = 180
DOC = (Path(__file__).resolve().parents[1] / "tokenlake" / "data" / "demo_document.txt").read_text()



class Serve:
    """One `tokenlake serve --json` process and its events."""

    def __init__(self, home: Path, control: int, http: int, *flags: str) -> None:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("TOKENLAKE_")},
               "TOKENLAKE_HOME": str(home)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenlake.tools.cli", "serve", "--instances", "2", "--pool-mb", "32",
             "--control-port", str(control), "--http-port", str(http), "--json", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.http = http

    def ready(self) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        for line in self.proc.stdout:  # the process prints an event per line, then ends
            event = json.loads(line)
            if event["event"] == "ready":
                return event
            assert time.monotonic() < deadline, "serve did not get ready in time"
        raise AssertionError(f"serve ended before ready: {self.proc.stderr.read()[-2000:]}")

    def ask(self, question: str) -> tuple[str, int]:
        body = json.dumps({"model": "smollm2-135m", "prompt": f"{DOC}\n\nQuestion: {question}\nAnswer:",
                           "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.http}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
        return answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def serving(tmp_path):
    """Starts serve processes; kills every one of them and every engine they left."""
    made: list[Serve] = []
    engines: list[int] = []
    ports = free_ports(2)  # below the ephemeral range: no engine of the serve takes one first

    def start(*flags: str) -> Serve:
        made.append(Serve(tmp_path, *ports, *flags))
        return made[-1]

    def remember_engines() -> dict:
        state = pool_state.read(tmp_path / f"pool-{ports[0]}.json")
        engines.extend(pid for _, _, pid, _ in state["engines"])
        return state

    try:
        yield start, remember_engines
    finally:
        for serve in made:
            serve.close()
        for pid in engines:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _gone(pids, prefix, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(map(pid_alive, pids)) or list_buffers(prefix):
        assert time.monotonic() < deadline, ([p for p in pids if pid_alive(p)], list_buffers(prefix))
        time.sleep(0.1)


def test_restarts_adopt_the_pool_and_answer_from_its_cache(serving, tmp_path):
    start, remember = serving
    tier = ("--tier-path", str(tmp_path / "tier"), "--tier-mb", "96")
    first = start(*tier)
    assert first.ready()["restored"] is None
    first.ask("Who is it about?")
    text, hit = first.ask("What happened?")
    assert hit > 200  # the document was cached
    state = remember()
    first.kill()  # an OOM kill, a crash

    second = start(*tier)
    ready = second.ready()
    assert ready["restored"] > 0
    creds = json.loads(Path(ready["credentials"]).read_text())  # reused: the pool's own keys
    assert ready["credentials"] in state["leftovers"]
    assert creds["keys"]["member_secret"] == state["keys"]["member_secret"]
    again, hit_again = second.ask("What happened?")
    assert hit_again >= 0.9 * hit and again == text
    status = subprocess.run(
        [sys.executable, "-m", "tokenlake.tools.cli", "status", "--address", ready["address"],
         "--credentials", ready["credentials"], "--json"],
        capture_output=True, text=True, timeout=60, check=True)
    rows = json.loads(status.stdout)["instances"]
    assert all(r["adopted"] for r in rows) and sum(r["restored_segments"] for r in rows) == ready["restored"]
    second.kill()  # the adopting process dies too: its adopted engines wait again

    third = start(*tier)
    assert third.ready()["restored"] == ready["restored"]
    assert third.ask("What happened?") == (text, hit_again)
    third.proc.send_signal(signal.SIGTERM)
    assert third.proc.wait(60) == 0
    _gone([pid for _, _, pid, _ in state["engines"]], cluster_prefix(state["cluster_id"]), 10)
    assert not list(tmp_path.glob("*.json")), "a state or credentials file outlived the pool"

    fourth = start(*tier)  # a new pool, empty slabs, on the tier the others wrote through to
    ready = fourth.ready()
    remember()
    assert ready["restored"] is None and ready["tier_segments"] > 0
    again, hit_tier = fourth.ask("What happened?")
    # all of it, the pages of the segment it shares in part too (that segment read back whole)
    assert again == text and hit_tier == hit_again
    fourth.proc.send_signal(signal.SIGTERM)
    assert fourth.proc.wait(60) == 0


def test_a_restart_with_another_segment_size_refuses_and_the_old_engines_end(serving, tmp_path):
    start, remember = serving
    grace = 15  # a cold start of the second serve, torch imported, fits well within it
    first = start("--orphan-grace-s", str(grace))
    first.ready()
    state = remember()
    first.kill()
    killed = time.monotonic()

    other = start("--segment-tokens", "32")
    assert other.proc.wait(120) == 2
    err = other.proc.stderr.read().strip().splitlines()
    assert len(err) == 1 and "segment_tokens 64" in err[0] and "AdoptionRefused" in err[0], err
    assert time.monotonic() - killed < grace, "the refusal came after the grace: it proves nothing"
    assert all(map(pid_alive, (pid for _, _, pid, _ in state["engines"]))), "the refusal touched the engines"
    (kept,) = tmp_path.glob("pool-*.json")  # the waiting pool's files: left to it
    assert pool_state.read(kept) == state and all(map(os.path.exists, state["leftovers"]))
    _gone([pid for _, _, pid, _ in state["engines"]], cluster_prefix(state["cluster_id"]), grace + 10)
    assert not list(tmp_path.glob("*.json")), "a state or credentials file outlived the pool"

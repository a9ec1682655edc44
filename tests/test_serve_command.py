"""`tokenlake serve` without --ray, as an operator runs it: a real process that serves a
local pool, answers `tokenlake.connect`, and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

import pytest

import tokenlake
from tokenlake.dataplane.shm_files import list_buffers

START_TIMEOUT_S = 120  # engines start as spawned processes: slow on a loaded 2-core machine


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """stdout lines of ``proc`` on a queue (None at the end), read by a daemon thread."""
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _next_event(q: queue.Queue, timeout_s: float) -> dict:
    line = q.get(timeout=timeout_s)
    assert line is not None, "serve ended without printing an event"
    return json.loads(line)


@pytest.fixture
def serve_process():
    before = set(list_buffers())
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenlake.tools.cli", "serve", "--instances", "2",
         "--pool-mb", "8", "--control-port", "0", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("TOKENLAKE_")},
    )
    try:
        yield proc, before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()


def test_serve_answers_connect_and_stops_cleanly_on_sigterm(serve_process):
    proc, before = serve_process
    events = _lines(proc)
    ready = _next_event(events, START_TIMEOUT_S)
    assert ready["event"] == "ready" and ready["instances"] == 2
    assert ready["address"].startswith("tcp://127.0.0.1:")
    assert set(list_buffers()) - before, "a served pool holds shared buffers"

    with tokenlake.connect(ready["address"]) as cp:
        prompt = tuple(range(1, 200))
        assert cp.get_prefix_tree().match(prompt).hit_tokens == 0  # a new pool holds nothing
        assert cp.stats().admitted_requests == 0

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.stderr.read()
    assert _next_event(events, 5)["event"] == "stopped"
    assert set(list_buffers()) - before == set(), "shared memory left behind"

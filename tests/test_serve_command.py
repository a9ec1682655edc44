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
import time

import pytest

import tokenlake
from tokenlake.dataplane.shm_files import list_buffers, pid_alive

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


def _next_event(q: queue.Queue, timeout_s: float, progress: list | None = None) -> dict:
    """The next event that is not a progress report (those go to ``progress``)."""
    while True:
        line = q.get(timeout=timeout_s)
        assert line is not None, "serve ended without printing an event"
        event = json.loads(line)
        if event["event"] != "progress":
            return event
        if progress is not None:
            progress.append(event["message"])


@pytest.fixture
def serve_process():
    before = set(list_buffers())
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenlake.tools.cli", "serve", "--instances", "2",
         "--pool-mb", "8", "--control-port", "0", "--http-port", "0", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("TOKENLAKE_")},
             "TOKENLAKE_HOME": os.environ["TOKENLAKE_HOME"]},  # credentials: this session's
    )
    try:
        yield proc, before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()


def _another_live_creator(buffer: str, ours: int) -> bool:
    """``tokenlake-<pid>-...`` of a live process other than ``ours`` (the serve)."""
    pid = buffer.split("-")[1]
    return pid.isdigit() and int(pid) != ours and pid_alive(int(pid))


def test_serve_answers_connect_and_stops_cleanly_on_sigterm(serve_process):
    proc, before = serve_process
    events = _lines(proc)
    assert _next_event(events, START_TIMEOUT_S)["event"] == "starting"  # progress first
    progress: list[str] = []
    ready = _next_event(events, START_TIMEOUT_S, progress)
    assert ready["event"] == "ready" and ready["instances"] == 2
    assert any("weights" in p for p in progress) and any("instances" in p for p in progress)
    assert ready["address"].startswith("tcp://127.0.0.1:")
    assert ready["http_url"].startswith("http://127.0.0.1:")
    assert set(list_buffers()) - before, "a served pool holds shared buffers"
    assert os.stat(ready["credentials"]).st_mode & 0o777 == 0o600

    with tokenlake.connect(ready["address"]) as cp:  # finds the credentials by the port
        prompt = tuple(range(1, 200))
        assert cp.get_prefix_tree().match(prompt).hit_tokens == 0  # a new pool holds nothing
        stats = cp.stats()
        assert stats.admitted_requests == 0

    status = subprocess.run(
        [sys.executable, "-m", "tokenlake.tools.cli", "status", "--address", ready["address"],
         "--json"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    assert [row["instance"] for row in shown["instances"]] == [0, 1]
    assert [row["slots_capacity"] for row in shown["instances"]] == [
        stats.pool.slots_capacity[i] for i in (0, 1)]
    assert shown["hit_rate"] == 0.0 and shown["segments"] == 0

    # the OpenAI-compatible API of the same process, with the official client
    import openai

    with openai.OpenAI(base_url=ready["http_url"] + "/v1", api_key="unused",
                       max_retries=0, timeout=120) as client:
        answer = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens >= 1 and answer.choices[0].message.content

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.stderr.read()
    assert _next_event(events, 5)["event"] == "stopped"
    # every new buffer but those of another live process (a test run sharing the machine)
    left = [b for b in set(list_buffers()) - before if not _another_live_creator(b, proc.pid)]
    assert left == [], "shared memory left behind"
    assert not os.path.exists(ready["credentials"])


def test_status_summarises_the_pool_stats():
    """The figures of `tokenlake status`, from stats with known values."""
    from tokenlake.core.control import ControlStats
    from tokenlake.core.pool import PoolStats
    from tokenlake.tools.cli.status import status_summary

    pool = PoolStats(segments=5, replicas=7, pinned=0, slots_used={0: 3, 1: 4},
                     slots_capacity={0: 10, 1: 10}, reads={0: 10, 1: 30}, evictions=2)
    s = status_summary(ControlStats(admitted_requests=4, hit_tokens=300, prefill_tokens=100,
                                    dedup_bytes=0, pool=pool))
    assert s["instances"] == [
        {"instance": 0, "slots_used": 3, "slots_capacity": 10, "reads": 10, "adopted": False,
         "restored_segments": 0},
        {"instance": 1, "slots_used": 4, "slots_capacity": 10, "reads": 30, "adopted": False,
         "restored_segments": 0},
    ]
    adopted = status_summary(ControlStats(admitted_requests=0, hit_tokens=0, prefill_tokens=0,
                                          dedup_bytes=0, pool=pool), (), {0: 5, 1: 0})
    assert [(r["adopted"], r["restored_segments"]) for r in adopted["instances"]] == [(True, 5), (True, 0)]
    assert s["hit_rate"] == 0.75  # 300 reused of 400 input tokens
    assert s["access_cv"] == pytest.approx(0.5)  # mean 20, population std 10
    assert (s["segments"], s["replicas"], s["evictions"]) == (5, 7, 2)


def test_status_without_a_pool_is_one_line_and_exit_2():
    out = subprocess.run([sys.executable, "-m", "tokenlake.tools.cli", "status", "--address",
                          "tcp://127.0.0.1:1", "--timeout", "0.3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("tokenlake: error: status:")


def _descendants(pid: int) -> dict[int, int]:
    """The live processes below ``pid``, each with its depth (1: a child; Linux ``/proc``)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, level = {}, [pid]
    for depth in range(1, 5):
        level = [p for p, parent in parents.items() if parent in level]
        out.update(dict.fromkeys(level, depth))
    return out


def test_a_command_stopped_by_sigterm_stops_what_it_started():
    """Any command (here a benchmark that runs a pool) unwinds on SIGTERM as on Ctrl-C:
    exit code 143, its engines stopped by it (not left to notice that their owner is
    gone), no process below it and no shared memory left. Before, SIGTERM killed the command
    where it stood, and ``bench vllm`` left its three vLLM servers running."""
    before = set(list_buffers())
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenlake.tools.cli", "bench", "roundtrip", "--repeats", "100000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:  # the pool is up once the measured passes begin
            seen.append(line)
            if "rows:" in line:
                break
        assert proc.poll() is None, "".join(seen)
        below = _descendants(proc.pid)  # the engines are the forkserver's children
        assert sum(depth == 2 for depth in below.values()) >= 2, "a query and a transfer engine"
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(60) == 143, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()
    assert "Traceback" not in rest and "is gone" not in rest, rest
    deadline = time.monotonic() + 30  # the forkserver and the resource tracker follow their parent
    while [pid for pid in below if pid_alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in below if pid_alive(pid)] == []
    assert [b for b in set(list_buffers()) - before if b.startswith(f"tokenlake-{proc.pid}-")] == []

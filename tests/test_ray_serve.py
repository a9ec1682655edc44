"""``tokenlake serve --ray``: the pool on Ray behind the same control port and
OpenAI-compatible HTTP API as ``tokenlake serve`` on one machine.

* the contract of ``serve(attach=...)`` with a stand-in cluster (no Ray started): what
  the attached service yields is entered after the cluster starts and left before it
  stops, its ``info()`` is in the ``ready`` event, its lock is held while failed
  instances are removed and restarted;
* the command in this process, joining the Ray modules' shared Ray (tests/ray_util.py)
  as it joins any running one, with every instance claiming another node: it starts a
  compute actor per instance and its HTTP API runs on them. This test comes first: the
  shared Ray, still up from test_ray_restart, stops before the next one starts its own;
* the command as an operator runs it, a process of its own on its own local Ray
  (``RAY_ADDRESS=local``, half a CPU per instance): ``tokenlake.connect`` and a chat
  completion through the ``openai`` client work, SIGTERM stops it with exit 0 and leaves
  no shared memory and no process (Ray's included) behind.

Other test runs on this machine make and unlink buffers of their own meanwhile: a
command's buffers are those its ``ready`` event names and those made by its processes.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

ray = pytest.importorskip("ray")

import ray_util  # noqa: E402
from service_util import terminate  # noqa: E402
from test_serve_command import _lines, _next_event  # noqa: E402

import tokenlake  # noqa: E402
from tokenlake.dataplane.shm_files import list_buffers  # noqa: E402
from tokenlake.deploy.ray import RayOptions  # noqa: E402

# the module (the package exports its function under the same name)
serve_module = importlib.import_module("tokenlake.deploy.ray.serve")

pytestmark = pytest.mark.ray

START_TIMEOUT_S = 90  # a new Ray, 6 actors and the model's weights, on a loaded 2-core machine

shared_ray = ray_util.shared_ray_fixture("function")  # held by the first test only


# ------------------------------------------------- the command in this process, on the shared Ray


def test_serve_ray_starts_compute_actors_when_instances_are_on_other_nodes(monkeypatch, shared_ray):
    """The driver maps only its own node's buffers: with instances elsewhere (here: every
    instance claims another node) the command starts a compute actor per instance and the
    HTTP API runs on them (the goodput policy), in this process, until Ctrl-C; it leaves
    the Ray it joined as it found it (no driver connected, nothing of its own left)."""
    from test_ray import _Lines

    from tokenlake.deploy.ray import RayCluster, RayComputeEngine

    monkeypatch.setattr(RayCluster, "node_id", lambda self, instance: "another node")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the command joins the Ray --ray names
    for name in [k for k in os.environ if k.startswith("TOKENLAKE_") and k != "TOKENLAKE_HOME"]:
        monkeypatch.delenv(name)
    engines: list = []  # what the HTTP API's GenerationLoop computes with
    real_compute_engine = RayCluster.compute_engine

    def compute_engine(self, *args):
        engines.append(real_compute_engine(self, *args))
        return engines[-1]

    monkeypatch.setattr(RayCluster, "compute_engine", compute_engine)
    out = _Lines()
    monkeypatch.setattr(sys, "stdout", out)
    assert not ray.is_initialized()
    seen: list[dict] = []
    answers: list = []

    def operator() -> None:
        ready = out.events.get(timeout=START_TIMEOUT_S)
        seen.append(ready)
        import openai

        with openai.OpenAI(base_url=ready["http_url"] + "/v1", api_key="unused",
                           max_retries=0, timeout=60) as client:
            answers.append(client.completions.create(
                model="smollm2-135m", prompt="The capital of France is", max_tokens=4,
                temperature=0))

    failure = ray_util.serve_at_a_terminal(
        ["serve", "--ray", shared_ray.address, "--instances", "2", "--pool-mb", "8",
         "--cpus-per-instance", "0.5", "--control-port", "0", "--http-port", "0", "--json"],
        operator)
    assert not failure, failure
    (answer,) = answers
    assert answer.choices[0].text and answer.usage.completion_tokens >= 1
    assert engines and all(isinstance(e, RayComputeEngine) for e in engines)
    (ready,) = seen
    assert all(inst["pids"].keys() >= {"host", "query", "transfer", "compute"} for inst in ready["instances"])
    assert not ray.is_initialized(), "the command left its driver connected"
    # this command's buffers: those it announced and any created by a process it ran
    names = {b for inst in ready["instances"] for b in inst["buffers"]}
    ours = {os.getpid(), *(pid for inst in ready["instances"] for pid in inst["pids"].values())}
    left = [b for b in list_buffers() if b in names or _creator_pid(b) in ours]
    assert names and left == [], "shared memory left behind"


# ------------------------------------------------------- serve(attach=...), no Ray


class _Recording:
    """A lock and the attached service's yield, both writing to ``log``."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __enter__(self):
        self.log.append("lock")
        return self

    def __exit__(self, *exc) -> None:
        self.log.append("unlock")


def _fake_cluster(log: list[str], stop):
    """A RayCluster stand-in whose instance 0 has failed once."""

    class FakeCluster:
        slots_per_instance = 4

        def __init__(self, *args, **kwargs) -> None:
            self.failed = {0: ("r1",)}

        def waiting(self, state) -> bool:  # no state file: a pool that starts empty
            assert state is None
            return False

        def discard(self, state) -> None:
            assert state is None

        def start(self):
            log.append("cluster up")

        def close(self) -> None:
            log.append("cluster down")

        def describe(self):
            return [{"instance": 0, "node_id": "n" * 20, "node_ip": "10.0.0.5",
                     "endpoints": {"query": "tcp://10.0.0.5:1", "transfer": "tcp://10.0.0.5:2"}}]

        def remove_failed(self):
            log.append("remove_failed")
            failed, self.failed = self.failed, {}
            return failed

        def restart_instance(self, instance: int):
            log.append(f"restart {instance}")
            stop.set()  # the watch loop ends after this round
            return ()

    return FakeCluster


@pytest.mark.parametrize("json_lines", [True, False])
def test_serve_enters_the_attached_service_and_holds_its_lock_while_recovering(
        monkeypatch, json_lines):
    log: list[str] = []
    stop = threading.Event()
    monkeypatch.setattr(serve_module, "RayCluster", _fake_cluster(log, stop))

    class Served:
        lock = _Recording(log)

        def info(self):
            return {"address": "tcp://127.0.0.1:7400", "http_url": "http://127.0.0.1:8000"}

    @contextmanager
    def attach(cluster):
        log.append(f"attach {type(cluster).__name__}")
        yield Served()
        log.append("detach")

    out: list[str] = []
    code = serve_module.serve(1, "smollm2-135m", 1 << 20, RayOptions(), poll_s=0.0,
                              out=out.append, json_lines=json_lines, stop=stop, attach=attach)
    assert code == 0
    assert log == ["cluster up", "attach FakeCluster", "lock", "remove_failed", "restart 0",
                   "unlock", "detach", "cluster down"]
    if json_lines:
        events = [json.loads(line) for line in out]
        assert [e["event"] for e in events] == ["ready", "serving", "failed", "restarted",
                                                "stopping", "stopped"]
        assert events[0]["address"] == "tcp://127.0.0.1:7400"
        assert events[0]["http_url"] == "http://127.0.0.1:8000"
        assert events[0]["instances"][0]["node_ip"] == "10.0.0.5"
    else:
        assert "control plane at tcp://127.0.0.1:7400 (tokenlake.connect)" in out[0]
        assert "OpenAI-compatible API at http://127.0.0.1:8000/v1" in out[0]
        assert out[-1].startswith("stopped: served ports closed")


# ------------------------------------------------------- the command, on its own Ray


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` now (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _pidfds(pids: list[int]) -> dict[int, int]:
    """pid -> pidfd (readable once the process has exited; immune to pid reuse)."""
    fds = {}
    for pid in pids:
        try:
            fds[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            pass
    return fds


def _still_running(fds: dict[int, int], timeout_s: float) -> list[int]:
    """Waits up to ``timeout_s`` for every process of ``fds`` to exit; those that did not."""
    poller = select.poll()
    by_fd = {fd: pid for pid, fd in fds.items()}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    left = set(by_fd)
    deadline = time.monotonic() + timeout_s
    while left and (remaining := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(remaining * 1000):
            poller.unregister(fd)
            left.discard(fd)
    return sorted(by_fd[fd] for fd in left)


@pytest.fixture
def ray_serve_process():
    """``tokenlake serve --ray local`` in a process of its own, on a Ray of its own; every
    process it started is ended and every pidfd closed afterwards, whatever happened."""
    before = set(list_buffers())
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLAKE_")}
    env["TOKENLAKE_HOME"] = os.environ["TOKENLAKE_HOME"]  # its credentials file: this session's
    env["RAY_ADDRESS"] = "local"  # a new Ray, never one another test or person started
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenlake.tools.cli", "serve", "--ray", "local",
         "--instances", "2", "--pool-mb", "8", "--cpus-per-instance", "0.5",
         "--control-port", "0", "--http-port", "0", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    tracked: dict[int, int] = {}
    try:
        yield proc, before, tracked
    finally:
        terminate(proc, 30)
        for pid in _still_running(tracked, 10):
            signal.pidfd_send_signal(tracked[pid], signal.SIGKILL)
        for fd in tracked.values():
            os.close(fd)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfds (Linux)")
def test_serve_ray_serves_connect_and_the_http_api_and_stops_cleanly(ray_serve_process):
    proc, before, tracked = ray_serve_process
    events = _lines(proc)
    progress: list[str] = []
    ready = _next_event(events, START_TIMEOUT_S, progress)
    assert ready["event"] == "ready", (ready, proc.stderr.read() if proc.poll() is not None else "")
    assert any("weights" in p for p in progress)
    assert ready["address"].startswith("tcp://127.0.0.1:")
    assert ready["http_url"].startswith("http://127.0.0.1:")
    assert _next_event(events, 10)["event"] == "serving"
    engine_pids = {pid for inst in ready["instances"] for pid in inst["pids"].values()}
    assert len(engine_pids) == 6  # host, query and transfer of 2 instances
    tracked.update(_pidfds(_descendants(proc.pid)))
    assert engine_pids <= set(tracked), "the Ray actors are processes the command started"
    buffers = {b for inst in ready["instances"] for b in inst["buffers"]}
    assert buffers <= set(list_buffers()) - before

    assert ready["credentials"].startswith(os.environ["TOKENLAKE_HOME"])
    with tokenlake.connect(ready["address"]) as cp:  # finds the credentials file by the port
        stats = cp.stats()
        assert sorted(stats.pool.slots_capacity) == [0, 1]
        assert stats.admitted_requests == 0

    import openai

    with openai.OpenAI(base_url=ready["http_url"] + "/v1", api_key="unused",
                       max_retries=0, timeout=60) as client:
        answer = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4, temperature=0)
    assert answer.choices[0].message.content and 1 <= answer.usage.completion_tokens <= 4
    with tokenlake.connect(ready["address"]) as cp:  # the request went through this pool
        assert cp.stats().admitted_requests == 1

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.stderr.read()
    assert [_next_event(events, 5)["event"] for _ in range(2)] == ["stopping", "stopped"]
    assert not os.path.exists(ready["credentials"])  # removed when the pool stopped
    # this command's buffers: those it announced and any created by a process it started
    # (other tests' Ray workers may create and unlink buffers of their own meanwhile)
    ours = {proc.pid, *tracked}
    left = [b for b in set(list_buffers()) - before
            if b in buffers or _creator_pid(b) in ours]
    assert left == [], "shared memory left behind"
    assert _still_running(tracked, 30) == [], "processes left behind"


def _creator_pid(name: str) -> int | None:
    """The pid in a buffer's name ``tokenlake-<pid>-<hex>-...``."""
    try:
        return int(name.split("-")[1])
    except (IndexError, ValueError):
        return None

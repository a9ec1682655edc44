"""One message of every control-plane server kind (``CP_*``), with the core's nested
dataclasses filled in, for the message tests (tests/test_messages.py) and the server's."""

from __future__ import annotations

import contextlib
import threading

from tokenlake.core.control import ControlStats
from tokenlake.core.cost_model import LatencyModel
from tokenlake.core.plans import (
    Batch,
    BatchRequest,
    PageCopy,
    Plans,
    PutItem,
    QueryItem,
    QueryPlan,
    QueryTask,
    RowSpan,
    TransferPlan,
)
from tokenlake.core.pool import PoolStats
from tokenlake.core.prefix_tree import MatchResult, SegmentLocation
from tokenlake.core.specs import HardwareProfile
from tokenlake.dataplane import messages as m
from tokenlake.dataplane.auth import ClusterKeys
from tokenlake.dataplane.shm_files import BufferSpec
from tokenlake.dataplane.wire import Kind

HARDWARE = HardwareProfile("test-cpu", 1e11, 2e10, 1e9, 1e-5, 8e9, notes="made up")
LATENCY = LatencyModel(0.01, 1e-4, 1e-9, 0.0, 2e-6, 1e-3)

PLANS = Plans(
    iteration=3,
    query_plans=(
        QueryPlan(0, 0, 1, 5, (RowSpan("a", 0, 3, 16, 16), RowSpan("b", 3, 5, 0, 0)),
                  (QueryTask(0, (QueryItem("a", 0, 3, (4, 9), (8, 8)),)),),
                  (QueryTask(1, (QueryItem("a", 0, 3, (2,), (5,)),)),)),
    ),
    transfer_plans=(
        TransferPlan(0, 0, 1, 5, (PutItem(1, 2, 5, 0, 3, b"\x01" * 16), PutItem(0, 7, 0, 3, 5, None)), 2,
                     (PageCopy(1, 2, 0, 7, 4),)),
    ),
    groups=((1,), (0, 1)),
)

STATS = ControlStats(4, 128, 512, 4096, PoolStats(
    segments=10, replicas=12, pinned=1, slots_used={0: 6, 1: 7}, slots_capacity={0: 64, 1: 64},
    private_slots=1, dedup_segments=2, evictions=0, replications=2, reads={0: 30, 1: 12}))

SERVICE_EXAMPLES: dict[Kind, m.WireMessage] = {
    Kind.CP_MATCH: m.CpMatch((5, 6, 7, 8), 3, "tenant-a"),
    Kind.CP_MATCHED: m.CpMatched(MatchResult(
        (b"k" * 16, b"j" * 16), ((SegmentLocation(0, 3),), (SegmentLocation(1, 2), SegmentLocation(0, 9))),
        28, b"p" * 16, 12, (SegmentLocation(1, 4),))),  # two whole segments of 8, then 12 tokens
    Kind.CP_CACHE_LOAD: m.CpCacheLoad(((1, 2, 3), ()), HARDWARE, LATENCY),
    Kind.CP_LOAD: m.CpLoad(0.25),
    Kind.CP_GEN_PLANS: m.CpGenPlans(
        (Batch((BatchRequest("a", (1, 2, 3), tuple(range(16))), BatchRequest("b", (9,)))),
         Batch((BatchRequest("c", (4,)),), "decode")), (2, 1), (None, 1)),
    Kind.CP_PLANS: m.CpPlans(PLANS, tuple((b"q" * 32, b"t" * 32) for _ in PLANS.query_plans)),
    Kind.CP_COMPLETE: m.CpComplete(3),
    Kind.CP_ABORT: m.CpAbort(4),
    Kind.CP_FINISH_REQUEST: m.CpFinishRequest("a"),
    Kind.CP_STATS: m.CpStats(),
    Kind.CP_STATS_RESULT: m.CpStatsResult(STATS, (0, 1), "smollm2-135m/f32/C64/vllm-cpu", 64, (
        m.SessionInfo(1, 4242, "vllm-worker-0", 12.5, 0.25, 1, 3, (0, 1)),),
        (("q", (8, 4, 2)), ("kv", (2, 8, 2, 2, 4)))),
    Kind.CP_CLIENT_INFO: m.CpClientInfo(1),
    Kind.CP_LEASE_PREFIX: m.CpLeasePrefix("r1", (5, 6, 7, 8), "tenant-a"),
    Kind.CP_LEASED: m.CpLeased((SegmentLocation(0, 3), SegmentLocation(1, 7)),
                               ((0, b"r" * 32), (1, b"s" * 32))),
    Kind.CP_CLIENT_INFO_RESULT: m.CpClientInfoResult(
        1, {"query": "tcp://127.0.0.1:5001", "transfer": "tcp://127.0.0.1:5002"},
        {"q": BufferSpec("tokenlake-1-ab-q-1", (8, 4, 2), "float32")}, 5.0,
        ClusterKeys.generate().member_view().to_dict(),
        BufferSpec("tokenlake-1-ab-slab-1", (16, 30, 2, 3, 128, 64), "float32"),
        ((0, BufferSpec("tokenlake-1-ab-slab-0", (16, 30, 2, 3, 128, 64), "float32")),)),
    Kind.CP_OPEN_SESSION: m.CpOpenSession(4242, "vllm-worker-0"),
    Kind.CP_SESSION: m.CpSession(3, 0.5, 3.0),
    Kind.CP_HEARTBEAT: m.CpHeartbeat(),
    Kind.CP_CLOSE_SESSION: m.CpCloseSession(),
}


def serve_config(model, instances: int, pool_bytes: int, segment_tokens: int = 64, max_rows: int = 1024,
                   *, engine_host: str = "127.0.0.1", insecure: bool = False, kv_layout: str = "tokenlake",
                   page_tokens: int | None = None, kv_dtype: str = "float32", **service):
    """The tests' short form of a :class:`ServeConfig`: the pool's sizes by position
    (as ``serve_local`` once took them), its engines' settings and the service's
    (``control_port``, ``http_port``, ``engine``, ...) by name."""
    from tokenlake.deploy.config import ClusterConfig
    from tokenlake.service.config import ServeConfig

    cluster = ClusterConfig(instances, model, pool_bytes, segment_tokens, max_rows, host=engine_host,
                            insecure=insecure, kv_layout=kv_layout, page_tokens=page_tokens, kv_dtype=kv_dtype)
    return ServeConfig(cluster, **service)


@contextlib.contextmanager
def serving_locally(*args, **kwargs):
    """``serve_local`` of ``serve_config(*args, **kwargs)`` (or of the one
    ``ServeConfig`` given) on a thread: yields its ``Served`` once ready; on exit stops
    it and asserts it ended without an error."""
    from tokenlake.service.config import ServeConfig
    from tokenlake.service.serve import serve_local

    config = args[0] if args and isinstance(args[0], ServeConfig) else serve_config(*args, **kwargs)
    stop, ready, served, errors = threading.Event(), threading.Event(), [], []

    def run() -> None:
        try:
            serve_local(config, stop=stop, on_ready=lambda s: (served.append(s), ready.set()))
        except Exception as e:  # reported below
            errors.append(e)
            ready.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert ready.wait(120) and not errors, errors
        yield served[0]
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive() and not errors, errors


@contextlib.contextmanager
def control_served(spec, instances: int, pool_bytes: int, segment_tokens: int, max_rows: int,
                   kv_layout: str):
    """A ``LocalCluster`` and its ``ControlServer``, with the credentials file that
    clients of this machine find by default: yields ``(cluster, server)``."""
    from tokenlake.dataplane import credentials
    from tokenlake.deploy.local import LocalCluster
    from tokenlake.service.server import ControlServer

    with LocalCluster(instances, spec, pool_bytes, segment_tokens=segment_tokens,
                      max_rows=max_rows, kv_layout=kv_layout) as cluster, \
            ControlServer(cluster) as server:
        path = credentials.write(credentials.default_path(server.address), server.credentials())
        try:
            yield cluster, server
        finally:
            credentials.remove(path)


def restart_failed(cluster, server) -> None:
    """Starts the instances with a dead engine again, empty (leaves a module's pool whole
    for its next tests), under the server's lock: its clients' sessions may be opening or
    closing meanwhile, and the cluster is the server's to change while it serves."""
    with server.lock:
        for instance in cluster.failed_instances():
            cluster.remove_instance(instance)
            cluster.restart_instance(instance)


def terminate(proc, grace_s: float = 30.0) -> None:
    """Stops a process a test started as an operator would (SIGTERM, so that it cleans
    up), and kills it if it has not ended within ``grace_s``."""
    import signal
    import subprocess

    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)

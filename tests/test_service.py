"""The control-plane server and ``tokenlake.connect`` (issue #16, part 1).

A real two-instance LocalCluster is served from this process; compute engines in other
processes (tests/service_worker.py) plan through the served control plane and move
tensors through their own data-plane clients. Also: every ``CP_*`` message round-trips,
garbage gets an error and changes nothing, a dead server is a typed error in time, and
everything is stopped and unlinked afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from dataplane_util import TINY
from service_util import HARDWARE, LATENCY, SERVICE_EXAMPLES, serve_config, serving_locally
from test_layering import GRAPH, layer_of

import tokenlake
from tokenlake.core.errors import ConfigError, EngineUnavailable, PlanError
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.dataplane import credentials, wire
from tokenlake.dataplane import messages as m
from tokenlake.dataplane.auth import connect_secure
from tokenlake.dataplane.shm_files import cluster_prefix, list_buffers
from tokenlake.dataplane.tensor_frames import WireError
from tokenlake.deploy.local import LocalCluster
from tokenlake.service.serve import serve_local
from tokenlake.service.server import ControlServer

C = 8
POOL_BYTES = 64 * TINY.num_layers * 2 * TINY.num_kv_heads * C * TINY.head_dim * 4  # 64 slots
WORKER = Path(__file__).with_name("service_worker.py")


@pytest.fixture(scope="module")
def served():
    """A two-instance cluster and its control server; on teardown both stop and every
    shared buffer of the cluster is gone."""
    cluster = LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=256)
    with cluster:
        prefix = cluster_prefix(cluster.cluster_id)
        with ControlServer(cluster) as server:
            yield cluster, server
    assert list_buffers(prefix) == []


def connect(server, **kw):
    """A client of ``server`` holding its member credentials."""
    return tokenlake.connect(server.address, credentials=server.credentials(), **kw)


def run_worker(server, request_id: str, seed: int, shared: int) -> dict:
    """tests/service_worker.py in another process; it finds the credentials where
    ``tokenlake serve`` writes them ($TOKENLAKE_HOME, a directory of this session)."""
    creds = credentials.write(credentials.default_path(server.address), server.credentials())
    try:
        done = subprocess.run(
            [sys.executable, str(WORKER), server.address, request_id, str(seed), str(shared)],
            cwd=WORKER.parent, capture_output=True, text=True, timeout=300, check=False)
    finally:
        credentials.remove(creds)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def snapshot(cluster) -> tuple:
    cp = cluster.control
    cp.check()
    return cp.stats(), cp.live_requests, cp.get_prefix_tree().match(list(range(64))).keys


# ---------------------------------------------------------------- messages


@pytest.mark.parametrize("kind", list(SERVICE_EXAMPLES), ids=lambda k: k.name)
def test_every_service_message_round_trips_exactly(kind):
    message = SERVICE_EXAMPLES[kind]
    msg_id, got = m.decode(message.encode(5))
    assert msg_id == 5 and got == message and type(got) is type(message)


def test_plans_come_back_as_the_cores_dataclasses():
    got = m.decode(SERVICE_EXAMPLES[wire.Kind.CP_PLANS].encode(1))[1].plans
    qp, tp = got.query_plans[0], got.transfer_plans[0]
    assert type(qp.spans) is tuple and type(qp.tasks[0].items[0].slots) is tuple
    assert tp.puts[0].key == b"\x01" * 16 and tp.puts[1].key is None
    assert got.groups == ((1,), (0, 1))


def test_a_refused_nested_value_names_its_path():
    body = SERVICE_EXAMPLES[wire.Kind.CP_GEN_PLANS].body()
    body["batches"][0]["requests"][1]["new_token_ids"][0] = "9"
    with pytest.raises(WireError, match=r"batches\[0\]\.requests\[1\]\.new_token_ids\[0\]"):
        m.parse(wire.decode(wire.encode(wire.Kind.CP_GEN_PLANS, 1, body)))
    body = SERVICE_EXAMPLES[wire.Kind.CP_CACHE_LOAD].body()
    body["hardware"]["flops"] = -1.0  # the dataclass's own check refuses it
    with pytest.raises(WireError, match="hardware"):
        m.parse(wire.decode(wire.encode(wire.Kind.CP_CACHE_LOAD, 1, body)))


def test_the_remote_client_needs_only_the_core_and_the_data_plane():
    layers = {layer_of(dst) for dst in GRAPH.successors("tokenlake.service.remote")}
    assert layers <= {"core", "dataplane"}, layers


# ---------------------------------------------------------------- a served pool


def test_a_second_process_hits_what_the_first_stored(served):
    cluster, server = served
    shared = 5 * C
    first = run_worker(server, "w1", 1, shared)
    assert first["hit_tokens"] == 0 and first["stored"] >= shared
    second = run_worker(server, "w2", 2, shared)
    assert second["hit_tokens"] == shared
    assert second["worst"] < 1e-5, second
    assert cluster.control.live_requests == ()
    with connect(server) as cp:
        stats = cp.stats()
        assert stats.hit_tokens >= shared and stats.pool.slots_used == cluster.control.stats().pool.slots_used
        assert cp.instances == (0, 1)


def test_remote_calls_match_the_in_process_ones(served):
    cluster, server = served
    with connect(server) as cp:
        reqs = [list(range(3, 40)), [7, 8, 9]]
        assert cp.get_cache_load(reqs, HARDWARE, LATENCY) == cluster.control.get_cache_load(reqs, HARDWARE, LATENCY)
        assert cp.get_prefix_tree().match(reqs[0]) == cluster.control.get_prefix_tree().match(reqs[0])
        plans = cp.gen_plans([Batch((BatchRequest("ab", (4, 5, 6)),))], [1])
        assert plans.query_plans[0].spans[0].request_id == "ab"  # the client's own name
        internal = f"{cp.session.session}/ab"  # in the control plane: in its session's namespace
        assert internal in cluster.control.live_requests
        cp.abort(plans)  # undoes the admission too
        assert internal not in cluster.control.live_requests
        with pytest.raises(PlanError):
            cp.finish_request("ab")
        with pytest.raises(PlanError):
            cp.complete(plans)  # already aborted
        with pytest.raises(PlanError):
            cp.gen_plans([Batch(())], [1])
        assert cluster.control.live_requests == ()
        cluster.control.check()


def test_closing_a_client_aborts_the_plans_it_left_in_flight(served):
    cluster, server = served
    with connect(server) as cp:
        cp.gen_plans([Batch((BatchRequest("left", (1, 2, 3, 4)),))], [1])
        assert f"{cp.session.session}/left" in cluster.control.live_requests
    assert cluster.control.live_requests == ()
    cluster.control.check()


def test_concurrent_clients_are_serialised(served):
    cluster, server = served
    errors = []

    def drive(worker: int) -> None:
        try:
            with connect(server) as cp:
                for i in range(15):
                    rid = f"c{worker}-{i}"
                    plans = cp.gen_plans([Batch((BatchRequest(rid, tuple(range(worker, worker + 20))),))], [1])
                    if i % 2:
                        cp.abort(plans)
                    else:  # metadata only: these tokens are no other test's prefix
                        cp.complete(plans)
                        cp.finish_request(rid)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert cluster.control.live_requests == ()
    cluster.control.check()


@pytest.mark.parametrize("frames", [
    [b"garbage"],
    [b""],
    m.Ping().encode(3),  # a kind the server does not serve
    wire.encode(wire.Kind.CP_GEN_PLANS, 4, {"batches": [{"requests": "x"}], "dops": [1]}),
    wire.encode(wire.Kind.CP_COMPLETE, 5, {"iteration": 999}),
], ids=["not-msgpack", "empty", "ping", "bad-batch", "unknown-iteration"])
def test_garbage_gets_an_error_and_changes_nothing(served, frames):
    cluster, server = served
    before = snapshot(cluster)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    connect_secure(sock, cluster.keys)  # a member: garbage from inside the boundary
    try:
        sock.connect(server.address)
        sock.send_multipart(frames)
        reply = m.parse(wire.recv(sock, 5.0))
    finally:
        sock.close(0)
        ctx.term()
    assert isinstance(reply, m.ErrorReply), reply
    assert reply.type in {"WireError", "PlanError", "SessionEnded"}, reply  # no session: refused
    assert snapshot(cluster) == before
    with connect(server) as cp:  # and it keeps serving
        assert cp.instances == (0, 1)


def test_a_dead_server_is_a_typed_error_within_the_timeout():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(0)
    ctx.term()
    with tokenlake.connect(f"tcp://127.0.0.1:{port}", timeout_s=0.3) as cp:
        start = time.monotonic()
        with pytest.raises(EngineUnavailable, match="did not answer CP_STATS within 0.3 s"):
            cp.stats()
        assert time.monotonic() - start < 2.0


def test_the_server_stops_and_a_client_then_times_out(served):
    cluster, _ = served
    server = ControlServer(cluster)
    assert server.address == ""  # the constructor only stores
    with server:
        address = server.address
        with tokenlake.connect(address, credentials=server.credentials()) as cp:
            assert cp.instances == (0, 1)
    with tokenlake.connect(address, timeout_s=0.3, credentials=server.credentials()) as cp:
        with pytest.raises(EngineUnavailable):
            cp.stats()


# ---------------------------------------------------------------- serve_local


def test_serve_local_serves_until_stopped_and_cleans_up():
    with serving_locally(TINY, 2, POOL_BYTES, C, 64, control_port=0) as served:
        assert served.http is None, "no weights for this model shape: no HTTP API"
        prefix = cluster_prefix(served.control.cluster.cluster_id)
        assert list_buffers(prefix)  # the buffers exist while it serves
        with tokenlake.connect(served.info()["address"]) as cp:
            assert cp.instances == (0, 1)
            client = cp.client(1)
            assert client.instance == 1 and client.q.shape[0] == 64
            info = cp.client_info(1)
            assert set(info.endpoints) == {"query", "transfer"}
            assert set(info.buffers) == {"q", "out_o", "out_lse", "kv", "bell"}
            with pytest.raises(ConfigError, match="no instance 5"):
                cp.client_info(5)
    assert list_buffers(prefix) == []


def test_serve_local_on_a_taken_port_fails_and_leaves_nothing(served):
    _, server = served
    port = int(server.address.rsplit(":", 1)[1])
    before = set(list_buffers())
    with pytest.raises(ConfigError, match="cannot bind the control port"):
        serve_local(serve_config(TINY, 1, POOL_BYTES, C, 64, control_port=port))
    assert set(list_buffers()) <= before


def test_a_remote_client_leases_a_cached_prefix(served):
    """``lease_prefix`` over the control port: the locations of the leased replicas, typed
    refusals, released by ``finish_request`` (what the vLLM connector reads KV by)."""
    from tokenlake.core.errors import PrefixNotCached

    cluster, server = served
    tokens = tuple(range(900, 900 + 2 * C + 3))  # metadata only: no other test's prefix
    with connect(server) as cp:
        plans = cp.gen_plans([Batch((BatchRequest("lp-a", tokens),))], [1])
        cp.complete(plans)
        cp.finish_request("lp-a")
        locs = cp.lease_prefix("lp-b", tokens[:2 * C])
        tree = cluster.control.get_prefix_tree()
        match = tree.match(tokens[:2 * C])
        assert len(locs) == 2 and all(loc in reps for loc, reps in zip(locs, match.replicas))
        assert f"{cp.session.session}/lp-b" in cluster.control.live_requests
        with pytest.raises(PrefixNotCached):
            cp.lease_prefix("lp-c", tokens[:C + 1])
        with pytest.raises(PlanError, match="live already"):
            cp.lease_prefix("lp-b", tokens[:C])
        cp.finish_request("lp-b")
    assert cluster.control.live_requests == ()
    cluster.control.check()


def test_status_lists_sessions_with_what_they_hold(served):
    from tokenlake.tools.cli.status import print_status, status_summary

    cluster, server = served
    with connect(server, label="worker-a") as cp, connect(server) as reader:
        assert reader.stats_and_sessions()[1] == ()  # reading opens no session
        plans = cp.gen_plans([Batch((BatchRequest("held", tuple(range(500, 520))),))], [1])
        cp.client(plans.query_plans[0].home)
        stats, sessions = reader.stats_and_sessions()
        (info,) = sessions
        assert (info.label, info.iterations, info.requests) == ("worker-a", 1, 1)
        assert info.instances == (plans.query_plans[0].home,) and info.pid > 0
        summary = status_summary(stats, sessions)
        assert summary["sessions"][0]["label"] == "worker-a"
        print_status(summary, server.address)  # the table prints
        cp.abort(plans)
    assert server.sessions.infos() == ()
    assert cluster.control.live_requests == ()

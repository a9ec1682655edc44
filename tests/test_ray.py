"""The pool deployed on Ray (issue #7): the data-plane scenarios of test_dataplane.py on
Ray actors (and, side by side, on LocalCluster), an engine actor killed mid-run, an
instance removed and restarted, clean shutdown, ``tokenlake serve --ray``, and SmolLM2
served through compute-engine actors (one per instance) equal to the reference engine.

The Ray modules' shared head node (tests/ray_util.py: 2 CPUs, no GPU, no dashboard)
serves the whole module, this process its driver; the shared pool and the ``serve`` test
ask for half a CPU per instance, the compute-actor pool for a quarter, so that all of
them fit at once."""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

import ray_util  # noqa: E402
from dataplane_util import TINY, check_iteration, tier_round_trip  # noqa: E402
from test_dataplane import POOL_BYTES, C, run_iteration  # noqa: E402
from test_dataplane import (  # noqa: E402  (the scenarios themselves, run on both cluster types)
    test_migration_moves_a_segment_and_queries_stay_exact as migration_scenario,
)
from test_dataplane import (  # noqa: E402
    test_pool_query_equals_monolithic_attention as pool_scenario,
)
from test_dataplane import (  # noqa: E402
    test_replicated_segments_give_the_same_result as replication_scenario,
)
from test_dataplane import (  # noqa: E402
    test_the_compute_engine_side_copies_nothing as no_copy_scenario,
)

from tokenlake.core.errors import ConfigError, EngineUnavailable, PlanError  # noqa: E402
from tokenlake.core.plans import Batch, BatchRequest  # noqa: E402
from tokenlake.dataplane.shm_files import list_buffers  # noqa: E402
from tokenlake.deploy.local import LocalCluster  # noqa: E402
from tokenlake.deploy.ray import RayCluster, RayComputeEngine, RayOptions  # noqa: E402
from tokenlake.deploy.ray.fit import NodeResources, check_fit  # noqa: E402
from tokenlake.generation import GenerationLoop, GenerationRequest  # noqa: E402

pytestmark = pytest.mark.ray

OPTIONS = RayOptions(cpus_per_instance=0.5)


shared_ray = ray_util.shared_ray_fixture()


@pytest.fixture(scope="module")
def ray_session(shared_ray):
    """This process as the shared Ray's driver for the module; yields the dict of Ray
    clusters shared by its tests, which are closed before the driver disconnects."""
    with ray_util.driver(shared_ray):
        shared: dict = {}
        try:
            yield shared
        finally:
            for pool in shared.values():
                pool.close()


@pytest.fixture
def ray_pool(ray_session):
    """The shared 2-instance RayCluster, started on first use. A test may close it (the
    clean-shutdown test does); the next test to ask gets a new one."""
    pool = ray_session.get("pool")
    if pool is None or pool.placement_group is None:
        pool = ray_session["pool"] = RayCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=256,
                                                peer_timeout_s=1.0, start_timeout_s=60.0, options=OPTIONS)
        pool.start()
    return pool


@pytest.fixture(scope="module")
def local_pool():
    with LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=256) as pool:
        yield pool


@pytest.fixture(params=["local", "ray"])
def cluster(request):
    return request.getfixturevalue(f"{request.param}_pool")


def test_pool_query_equals_monolithic_attention(cluster):
    pool_scenario(cluster)


def test_replication_migration_and_engine_stats(cluster):
    replication_scenario(cluster)
    migration_scenario(cluster)
    no_copy_scenario(cluster)


def test_both_launchers_share_one_buffer_layout(ray_pool, local_pool):
    """Built with the same arguments, both launchers give an instance the same buffers:
    the Ray hosts create exactly what the shared layout names, of the shapes it gives."""
    assert ray_pool.layout == local_pool.layout
    shapes = local_pool.layout.shapes()
    for i in ray_pool.instances:
        prefix = ray_pool.buffer_prefix(i)
        assert list_buffers(prefix) == sorted(f"{prefix}{name}-{i}" for name in shapes)
        for name, spec in ray_pool.client_info(i)["buffers"].items():
            assert tuple(spec["shape"]) == shapes[name] == tuple(getattr(local_pool.client(i), name).shape)
        assert ray_pool.slab(i).shape == local_pool.slab(i).shape == shapes["slab"]


def test_a_bfloat16_pool_on_ray_queries_replicates_and_migrates(ray_session):
    """Issue #21: the Ray hosts create the slab and put buffers in the pool's dtype, and
    queries, replicas and migrations read and copy it as the local launcher does."""
    import torch

    with RayCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=256, peer_timeout_s=1.0,
                    start_timeout_s=60.0, options=OPTIONS, kv_dtype="bfloat16") as pool:
        assert all(pool.slab(i).dtype == torch.bfloat16 for i in pool.instances)
        assert pool.client_info(0)["buffers"]["kv"]["dtype"] == "bfloat16"
        pool_scenario(pool)
        replication_scenario(pool)
        migration_scenario(pool)


# ------------------------------------------------------------- fitting the cluster

def _nodes(*cpus: float, gpus: float = 0.0) -> list[NodeResources]:
    res = [{"CPU": c, "GPU": gpus} if gpus else {"CPU": c} for c in cpus]
    return [NodeResources(f"10.0.0.{k + 1}", r) for k, r in enumerate(res)]


def _total(nodes: list[NodeResources]) -> dict[str, float]:
    out: dict[str, float] = {}
    for node in nodes:
        for r, v in node.resources.items():
            out[r] = out.get(r, 0.0) + v
    return out


def test_a_ray_pool_with_a_disk_tier_reads_pushed_out_segments_back_and_outlives_itself(ray_session, tmp_path):
    """A Ray pool's transfer engines keep write-through copies in a directory of their
    node's disk: a document pushed out of both slabs comes back from them with exact
    answers; the files outlive the pool, and a new pool on the same directory adopts
    them and answers from them. (A tier in host memory takes the same way to the
    engines, ``tier_spec``, less the directory.)"""
    tier = {"tier_bytes": 4 * POOL_BYTES, "tier_path": str(tmp_path)}
    doc = [random.Random(5).randrange(3, 900) for _ in range(3 * C + 2)]
    with RayCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=256, peer_timeout_s=1.0,
                    start_timeout_s=60.0, options=OPTIONS, **tier) as pool:
        slots = 2 * pool.slots_per_instance
        check_iteration(pool, {"d": doc}, {"d": len(doc)}, {"d": 0})
        pool.control.finish_request("d")
        tier_round_trip(pool, doc, C, slots + 8)
        assert pool.control.stats().pool.tier.promotions == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["instance-0", "instance-1"]
    with RayCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=256, peer_timeout_s=1.0,
                    start_timeout_s=60.0, options=OPTIONS, **tier) as again:
        cp = again.control
        m = cp.get_prefix_tree().match(doc, max_tokens=len(doc) - 1)
        assert not m.keys and len(m.tier_keys) == 3, "every whole segment adopted from the files"
        tokens = {"q": doc[:3 * C] + [7, 8, 9]}
        assert cp.promote([(tokens["q"], None)]) == 3
        assert check_iteration(again, tokens, {"q": 3}, {"q": 3 * C}) == {"q": 3 * C}
        cp.check()


@pytest.mark.parametrize("n, bundle, strategy, cpus, match", [
    (4, {"CPU": 3.0}, "PACK", (2.0,),
     r"4 bundles of \{CPU: 3\} need 12 CPU; the Ray cluster has 2 CPU in all \(1 node: 10.0.0.1 has \{CPU: 2\}\)"),
    (1, {"CPU": 3.0}, "PACK", (2.0, 2.0),
     r"no node of the Ray cluster can hold one bundle of \{CPU: 3\} \(2 nodes: 10.0.0.1 has \{CPU: 2\}, "),
    (3, {"CPU": 1.0}, "STRICT_SPREAD", (4.0, 0.5),
     r"STRICT_SPREAD puts each of the 3 bundles of \{CPU: 1\} on a node of its own, but only 1 of the Ray "
     r"cluster's 2 nodes can hold one"),
    (3, {"CPU": 1.0}, "STRICT_PACK", (2.0, 2.0),
     r"STRICT_PACK puts all 3 bundles of \{CPU: 1\} on one node, but a node holds at most 2"),
    (3, {"CPU": 1.5}, "SPREAD", (2.0, 2.0, 0.5),
     r"3 bundles of \{CPU: 1.5\} do not fit the Ray cluster's nodes, which hold 2 of them in all"),
    (2, {"CPU": 1.0, "GPU": 1.0}, "PACK", (4.0,),
     r"2 bundles of \{CPU: 1, GPU: 1\} need 2 GPU; the Ray cluster has 0 GPU in all"),
])
def test_check_fit_names_what_was_asked_and_what_the_cluster_has(n, bundle, strategy, cpus, match):
    nodes = _nodes(*cpus)
    with pytest.raises(ConfigError, match=match):
        check_fit(n, bundle, strategy, _total(nodes), nodes)


@pytest.mark.parametrize("n, bundle, strategy, cpus, gpus", [
    (4, {"CPU": 0.25}, "STRICT_PACK", (1.0,), 0.0),  # exactly full
    (3, {"CPU": 0.1}, "PACK", (0.3,), 0.0),  # 3 * 0.1 is 0.30000000000000004 in floats
    (3, {"CPU": 1.0}, "PACK", (2.0, 2.0), 0.0),
    (2, {"CPU": 2.0, "GPU": 1.0}, "STRICT_SPREAD", (2.0, 2.0, 1.0), 1.0),
])
def test_check_fit_accepts_bundles_that_fit(n, bundle, strategy, cpus, gpus):
    nodes = _nodes(*cpus, gpus=gpus)
    check_fit(n, bundle, strategy, _total(nodes), nodes)


@pytest.mark.parametrize("options, match", [
    (RayOptions(cpus_per_instance=3), r"2 bundles of \{CPU: 3\} need 6 CPU; the Ray cluster has 2 CPU in all"),
    (RayOptions(cpus_per_instance=0.25, gpus_per_instance=1), r"need 2 GPU; the Ray cluster has 0 GPU in all"),
    (RayOptions(cpus_per_instance=0.25, strategy="STRICT_SPREAD"),
     r"STRICT_SPREAD puts each of the 2 bundles .* only 1 of the Ray cluster's 1 nodes can hold one"),
])
def test_a_request_the_ray_cluster_cannot_hold_fails_at_once(ray_session, options, match):
    """More than the shared Ray (one node, 2 CPUs, no GPU) has: a ConfigError naming the
    resources, in well under 10 s although the start-up timeout is 120 s; nothing is
    left placed."""
    before = ray.util.placement_group_table()
    cluster = RayCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, start_timeout_s=120.0,
                         options=options)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=match):
        cluster.start()
    assert time.monotonic() - t0 < 5.0
    assert cluster.placement_group is None and ray.util.placement_group_table() == before


def test_busy_resources_wait_place_timeout_and_say_so(ray_pool):
    """Two bundles of 1 CPU fit the 2-CPU Ray, but the shared pool holds one of them:
    after ``place_timeout_s`` (not the start-up timeout) an EngineUnavailable says the
    resources are busy, and the pending placement group is removed."""
    options = RayOptions(cpus_per_instance=1.0, place_timeout_s=1.0)
    cluster = RayCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, start_timeout_s=120.0,
                         options=options)
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailable, match=r"2 bundles of \{CPU: 1\} \(PACK\) within 1 s: the cluster "
                                                r"has the resources, but they are busy \([0-9.]+ of 2 CPU free"):
        cluster.start()
    assert 1.0 <= time.monotonic() - t0 < 5.0
    assert cluster.placement_group is None
    assert all(pg["state"] != "PENDING" for pg in ray.util.placement_group_table().values())
    assert ray_pool.instances == (0, 1) and not ray_pool.failed_instances()


def test_start_up_progress_is_logged(ray_session, caplog):
    """A request that fits starts, and says so at INFO as it goes: placing the bundles,
    starting each instance's engines, each instance ready, the pool ready."""
    caplog.set_level(logging.INFO, logger="tokenlake.deploy.ray")
    with RayCluster(1, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, start_timeout_s=60.0,
                    options=RayOptions(cpus_per_instance=0.25)) as cluster:
        assert cluster.instances == (0,) and cluster.alive("query", 0) and cluster.alive("transfer", 0)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("tokenlake.deploy.ray")]
    expected = ["placing 1 bundle of {CPU: 0.25} (PACK) on the Ray cluster's 1 alive node(s)",
                "placed 1 bundle of {CPU: 0.25}", "starting instance 0's host and engines",
                "instance 0's query engine bound", "instance 0's transfer engine bound",
                "instance 0 ready on node", "pool ready: 1 instances on Ray"]
    found = [next((k for k, line in enumerate(lines) if line.startswith(e)), None) for e in expected]
    assert None not in found, (expected, lines)
    assert found.index(max(found)) == len(found) - 1 and found[0] == 0 and found[1] < found[2]


def test_the_ray_package_imports_without_torch():
    """The host actors import ``tokenlake.deploy.ray`` and never map a buffer: importing it
    loads neither torch nor the wire (which imports torch)."""
    code = ("import sys, tokenlake.deploy.ray; "
            "print([m for m in ('torch', 'tokenlake.dataplane.wire') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_a_malformed_peers_message_is_refused_and_the_engine_keeps_serving(ray_pool):
    import zmq

    from tokenlake.dataplane import wire
    from tokenlake.dataplane.auth import connect_secure
    from tokenlake.dataplane.messages import Ping, Pong, expect
    from tokenlake.dataplane.tensor_frames import WireError

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    connect_secure(sock, ray_pool.keys)  # a member: the actors got the driver's keys
    sock.connect(ray_pool.client_info(0)["endpoints"]["query"])
    try:
        for i, body in enumerate([{}, {"peers": [[1, "ipc:///tmp/x"]]}, {"peers": [["1", None]]}]):
            sock.send_multipart(wire.encode(wire.Kind.PEERS, i + 1, body))
            with pytest.raises(WireError, match="PEERS"):
                wire.raise_if_error(wire.recv(sock, 5.0))
        sock.send_multipart(Ping().encode(9))
        assert expect(wire.recv(sock, 5.0), Pong).instance == 0
    finally:
        sock.close(0)


def test_killed_actor_is_engine_unavailable_and_the_instance_restarts(ray_pool):
    cluster, cp = ray_pool, ray_pool.control
    rng = random.Random(1)
    tokens = {"r": [rng.randrange(3, 900) for _ in range(6 * C)]}
    run_iteration(cluster, tokens, {"r": 6 * C})
    plans = cp.gen_plans([Batch((BatchRequest("r", (5,)),), "decode")], [1])
    qp = plans.query_plans[0]
    remote = [t.instance for t in qp.tasks if t.instance != qp.home]
    assert remote, "the prefix should span both instances"
    victim = remote[0]
    old_prefix = cluster.buffer_prefix(victim)
    old_procs = [p for (_, i), p in cluster.processes().items() if i == victim]
    old_endpoints = cluster.client_info(victim)["endpoints"]
    client = cluster.client(qp.home)
    client.init_query(qp)
    client.query(0)  # healthy first

    cluster.kill("query", victim)  # ray.kill of the remote query engine's actor, mid-run
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailable):
        client.query(0)
    assert time.monotonic() - t0 < 5.0
    assert cluster.alive("query", qp.home) and cluster.failed_instances() == [victim]
    cp.abort(plans)
    lost = cluster.remove_failed()  # data plane down, segments out of the tree
    assert set(lost) == {victim} and "r" in lost[victim]
    assert victim not in cp.pool.instances and cluster.instances == (qp.home,)
    assert list_buffers(old_prefix) == [] and not any(p.alive() for p in old_procs)
    cp.finish_request("r")

    tokens["s"] = [rng.randrange(3, 900) for _ in range(3 * C + 2)]  # the survivor alone
    run_iteration(cluster, tokens, {"s": 3 * C + 1})
    run_iteration(cluster, tokens, {"s": 1})
    cp.finish_request("s")

    cluster.restart_instance(victim)  # empty slab, new addresses sent to the peers
    assert cluster.instances == (0, 1) and not cluster.failed_instances()
    assert cluster.client_info(victim)["endpoints"] != old_endpoints
    assert not cluster.slab(victim).any()
    tokens["u"] = [rng.randrange(3, 900) for _ in range(8 * C + 4)]
    tokens["v"] = [rng.randrange(3, 900) for _ in range(8 * C + 6)]
    plans = run_iteration(cluster, tokens, {"u": 8 * C + 3, "v": 8 * C + 5})  # two homes
    assert {qp.home for qp in plans.query_plans} == {0, 1}
    tree = cp.get_prefix_tree()
    for rid in ("u", "v"):  # both prefixes are spread over both instances again
        held = {loc.instance for key in tree.match(tokens[rid]).keys for loc in tree.replicas(key)}
        assert held == {0, 1}, (rid, held)
    run_iteration(cluster, tokens, {"u": 1, "v": 1})  # queries cross in both directions
    for rid in ("u", "v"):
        cp.finish_request(rid)


def test_close_leaves_no_shared_memory_and_no_processes(ray_pool):
    cluster = ray_pool
    procs = cluster.processes()
    prefixes = [cluster.buffer_prefix(i) for i in cluster.instances]
    pg = cluster.placement_group
    per_instance = len(cluster.layout.shapes())  # slab, q, out_o, out_lse, kv, records
    assert all(len(list_buffers(p)) == per_instance for p in prefixes) and all(p.alive() for p in procs.values())
    tokens = {"x": list(range(3, 3 + 2 * C + 2))}
    run_iteration(cluster, tokens, {"x": 2 * C + 1})
    cluster.kill("host", 0)  # the owner of instance 0's buffers crashes: its files stay for now,
    assert len(list_buffers(prefixes[0])) == per_instance
    run_iteration(cluster, tokens, {"x": 1})  # and the engines keep serving
    cluster.control.finish_request("x")
    cluster.close()
    assert not any(list_buffers(p) for p in prefixes)
    assert not any(p.alive() for p in procs.values())
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    assert cluster.placement_group is None


# ----------------------------------------------------------------- compute actors

NEW = ray_util.NEW
_short_prompts = ray_util.short_prompts


@pytest.fixture(scope="module")
def smollm(smollm2):
    """The shipped model, its tokenizer and reference engine (conftest's ``smollm2``)."""
    return smollm2


@pytest.fixture
def compute_pool(ray_session, smollm):
    """A 2-instance SmolLM2 RayCluster with a compute actor per instance, shared by the
    compute tests (started on first use, closed with the module's Ray). A quarter CPU
    per bundle, half of it for the compute actor."""
    pool = ray_session.get("compute")
    if pool is None or pool.placement_group is None:
        spec = smollm[0].config.to_model_spec("smollm2-135m")
        options = RayOptions(cpus_per_instance=0.25, engine_share=0.5)
        pool = ray_session["compute"] = RayCluster(2, spec, 48 << 20, segment_tokens=16, max_rows=512,
                                                   start_timeout_s=90.0, options=options, compute=True)
        pool.start()
    return pool


def test_generation_through_compute_actors_equals_the_reference(compute_pool, smollm):
    """``GenerationLoop`` on a RayCluster with compute actors picks the RayComputeEngine by
    itself; every batch runs in the actor of its home instance (both are used), and
    greedy output and logits equal the plain engine's, token for token."""
    weights, tok, ref = smollm
    cluster = compute_pool
    server = GenerationLoop(cluster, weights, chunk_tokens=64, keep_logits=True)
    assert isinstance(server.engine, RayComputeEngine)
    prompts = _short_prompts(tok)
    # The first request alone puts the shared prefix into the pool; the others reuse it.
    server.run([GenerationRequest("p0", prompts[0], NEW, (tok.eos_id,))])
    server.run([GenerationRequest(f"p{i}", p, NEW, (tok.eos_id,)) for i, p in enumerate(prompts[1:], 1)])
    assert set(server.engine.batches_run) == {0, 1}
    for i, prompt in enumerate(prompts):
        res = server.results[f"p{i}"]
        expected = ray_util.reference(ref, prompt, NEW, (tok.eos_id,))
        assert res.output_ids == list(expected.output_ids)
        assert len(res.logits) == len(expected.logits)
        for got, want in zip(res.logits, expected.logits):
            assert (got - want).abs().max().item() < 1e-4
    assert server.results["p1"].hit_tokens > 0 and server.results["p1"].hit_tokens % 16 == 0


def test_a_dop_2_prefill_on_two_compute_actors_equals_the_reference(compute_pool, smollm):
    """Every prefill chunk is split over both instances' compute actors, which compute
    their halves at once and pass the crossing request's K/V rows between them; greedy
    output and logits equal the plain engine's."""
    from scheduler.baselines.fcfs import FCFS

    weights, tok, ref = smollm
    server = GenerationLoop(compute_pool, weights, chunk_tokens=64, keep_logits=True, policy=FCFS(64, prefill_dop=2))
    prompts = _short_prompts(tok)[:2]
    for i, p in enumerate(prompts):  # one at a time: each prefill has both instances
        server.run([GenerationRequest(f"s{i}", p, NEW, (tok.eos_id,))])
    prefills = [b for d in server.decisions for b in d.batches if b.phase == "prefill"]
    assert prefills and all(b.dop == 2 for b in prefills)
    for i, prompt in enumerate(prompts):
        expected = ray_util.reference(ref, prompt, NEW, (tok.eos_id,))
        assert server.results[f"s{i}"].output_ids == list(expected.output_ids)
        for got, want in zip(server.results[f"s{i}"].logits, expected.logits):
            assert (got - want).abs().max().item() < 1e-4


def test_a_killed_compute_actor_is_engine_unavailable(compute_pool):
    """A compute actor killed between iterations: ``run`` raises EngineUnavailable (it
    waits for the other actor first), the pool itself is unharmed, the actor can be
    restarted; plans that do not cover the batches given are refused before anything
    runs; close() ends every actor."""
    cluster, cp = compute_pool, compute_pool.control
    engine = cluster.compute_engine()
    batches = [Batch((BatchRequest("k0", tuple(range(3, 40))),)),
               Batch((BatchRequest("k1", tuple(range(50, 80))),))]
    plans = cp.gen_plans(batches, [1, 1])
    homes = [qp.home for qp in plans.query_plans]
    assert sorted(homes) == [0, 1]
    cluster.kill("compute", homes[1])
    assert not cluster.alive("compute", homes[1])
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailable, match=f"compute actor of instance {homes[1]}"):
        engine.run(plans, batches)
    assert time.monotonic() - t0 < 5.0
    cp.abort(plans)
    assert not cluster.failed_instances()  # the query and transfer engines are fine

    cluster.restart_compute(homes[1])
    plans = cp.gen_plans(batches, [1, 1])
    out = engine.run(plans, batches)
    cp.complete(plans)
    assert set(out.logits) == {"k0", "k1"} and out.logits["k0"].shape == (cluster.model.vocab_size,)

    plans = cp.gen_plans([Batch((BatchRequest("k2", tuple(range(100, 140))),))], [2])
    with pytest.raises(PlanError, match="cover batches"):
        engine.run(plans, [])
    cp.abort(plans)
    for rid in ("k0", "k1"):
        cp.finish_request(rid)

    procs = cluster.processes()
    assert {role for role, _ in procs} == {"host", "query", "transfer", "compute"}
    cluster.close()
    assert not any(p.alive() for p in procs.values())


class _Lines:
    """A stdout that hands every JSON event line but progress reports to a queue (read
    from another thread)."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self._buf = ""

    def write(self, text: str) -> int:
        self._buf += text
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            event = json.loads(line) if line.startswith("{") else None
            if event is not None and event["event"] != "progress":
                self.events.put(event)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:  # the HTTP server's log set-up asks
        return False


def test_serve_command_reports_a_crash_and_stops_cleanly_on_ctrl_c(ray_session, monkeypatch):
    """``tokenlake serve --ray ADDRESS`` in this process (Ray is already up, so the
    command joins it): engines bind the named interface within the port range, it prints
    the addresses (the control port and HTTP API too: tests/test_ray_serve.py uses them),
    notices an engine process killed outside Ray, and on Ctrl-C (SIGINT) shuts everything
    down and exits 0."""
    from tokenlake.deploy.ray import ProcessRef

    out = _Lines()
    monkeypatch.setattr(sys, "stdout", out)
    address = ray.get_runtime_context().gcs_address
    argv = ["serve", "--ray", address, "--instances", "1", "--model", "smollm2-135m", "--pool-mb", "1",
            "--segment-tokens", "16", "--max-rows", "16", "--cpus-per-instance", "0.5",
            "--bind", "lo", "--ports", "47100-47199", "--no-restart", "--json",
            "--control-port", "0", "--http-port", "0"]
    seen: list[dict] = []

    def operator() -> None:  # what a person at the terminal does
        seen.append(out.events.get(timeout=90))  # ready
        seen.append(out.events.get(timeout=10))  # serving
        (inst,) = seen[0]["instances"]
        os.kill(inst["pids"]["query"], signal.SIGKILL)  # a crash Ray did not cause
        seen.append(out.events.get(timeout=30))  # failed

    failure = ray_util.serve_at_a_terminal(argv, operator)
    assert not failure, failure
    ready, serving, failed = seen
    assert [ready["event"], serving["event"], failed["event"]] == ["ready", "serving", "failed"]
    (inst,) = ready["instances"]
    assert failed["instance"] == 0
    assert ready["address"].startswith("tcp://127.0.0.1:") and ready["http_url"]
    for endpoint in inst["endpoints"].values():  # the interface named, a port of the range
        host, port = endpoint[len("tcp://"):].rsplit(":", 1)
        assert host == "127.0.0.1" and 47100 <= int(port) <= 47199
    events = []
    while not out.events.empty():
        events.append(out.events.get()["event"])
    assert events == ["stopping", "stopped"]
    assert not set(inst["buffers"]) & set(list_buffers())
    node = ray.get_runtime_context().get_node_id()
    assert not any(ProcessRef(node, pid).alive() for pid in inst["pids"].values())

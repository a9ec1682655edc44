"""The data plane with real processes: query and transfer engines of 1, 2 and 4
instances, segments spread and replicated over them (issue #3); the same in pools that
hold their K/V in bfloat16 and float16 (issue #21), checked against float64 attention
over the K/V as rounded to the pool's dtype."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import replace

import pytest
import torch
from dataplane_util import TINY, engine_request, execute, full_attention_check, reference_prefix

from tokenlake.core.errors import EngineUnavailable, NotAuthorized, PlanError
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.dataplane import grants, wire
from tokenlake.dataplane.messages import (
    AttendItem,
    ErrorReply,
    InstanceItems,
    PeerQuery,
    PeerQueryResult,
    Ping,
    Pong,
    Put,
    Query,
    RegisterQueryPlan,
    expect,
    parse,
)
from tokenlake.dataplane.tensor_frames import CopyStats, WireError
from tokenlake.deploy.local import LocalCluster

C = 8
POOL_BYTES = 64 * TINY.num_layers * 2 * TINY.num_kv_heads * C * TINY.head_dim * 4  # 64 slots


def run_iteration(cluster, tokens, new, dops=None, first_prefix=None, coalesce=False, homes=None, model=None):
    """Plans and executes one iteration; every request's query result is checked
    (``model``: the cluster's own by default)."""
    model = model or cluster.model
    first_prefix = first_prefix or {}
    cp = cluster.control
    n_batches = len(dops) if dops else min(len(new), cluster.n_instances)
    groups = [[] for _ in range(n_batches)]
    for i, (rid, n) in enumerate(new.items()):
        toks = tokens[rid]
        live = rid in cp.live_requests
        prefix = () if live else tuple(toks[: first_prefix.get(rid, 0)])
        start = cp.prefix_tokens(rid) if live else len(prefix)
        groups[i % n_batches].append(BatchRequest(rid, tuple(toks[start : start + n]), prefix))
    batches = [Batch(tuple(g)) for g in groups]
    plans = cp.gen_plans(batches, dops or [1] * len(batches), homes)
    results = execute(cluster, plans, tokens, new, model, coalesce=coalesce)
    cp.complete(plans)
    worst = 0.0
    kv_dtype = getattr(torch, cluster.kv_dtype)
    for (rid, _pos, layer), (q, o, lse, span) in results.items():
        ro, rlse = reference_prefix(tokens[rid], span.prefix_tokens, q, layer, model, kv_dtype=kv_dtype)
        if span.prefix_tokens == 0:
            assert torch.isinf(lse).all() and (lse < 0).all()
            continue
        worst = max(worst, (o.double() - ro).abs().max().item(), (lse.double() - rlse).abs().max().item())
        if span.position == span.prefix_tokens:  # span starts at the first new token
            eo, else_ = full_attention_check(tokens[rid], span, q, o, lse, layer, model, kv_dtype=kv_dtype)
            worst = max(worst, eo, else_)
    # float32 math on the CPU; a GPU pool's FlashInfer rounds q to the KV dtype as well
    assert worst < (2e-2 if cluster.slab(0).is_cuda else 1e-5), worst
    return plans


def _pool_id(p) -> str:
    return f"N{p[0]}" + ("" if p[1] == "float32" else f"-{p[1]}") + ("" if p[2] else "-messages")


_ON_GPU = (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))


@pytest.fixture(scope="module", params=[(1, "float32", True), (2, "float32", True), (4, "float32", True),
                                        (4, "float32", False), (2, "bfloat16", True), (3, "float16", True),
                                        pytest.param((3, "bfloat16", False, "cuda"), marks=_ON_GPU,
                                                     id="N3-bfloat16-cuda")],
                ids=_pool_id)
def cluster(request):
    """Pools of 1-4 instances; ``-messages``: remote shares asked of the peers' query
    engines (``share_slabs=False``, as between hosts) instead of read from their slabs;
    ``-cuda``: every buffer on the GPU (peers by message; head size 64, one FlashInfer
    compiles), run with ``pytest -m gpu`` where there is one."""
    n, kv_dtype, share, *on = request.param
    device = on[0] if on else "cpu"
    model = TINY if device == "cpu" else replace(TINY, name="tiny-gpu", head_dim=64)
    pool = POOL_BYTES * model.head_dim // TINY.head_dim  # 64 slots or more
    with LocalCluster(n, model, pool, segment_tokens=C, max_rows=256, kv_dtype=kv_dtype,
                      share_slabs=share, device=device) as c:
        yield c


def test_pool_query_equals_monolithic_attention(cluster):
    rng = random.Random(cluster.n_instances)
    doc = [rng.randrange(3, 900) for _ in range(5 * C + 3)]
    tokens = {"a": doc + [rng.randrange(3, 900) for _ in range(40)]}
    run_iteration(cluster, tokens, {"a": len(doc)})  # prefill: 5 segments + open tail
    # B reuses A's 5 cached segments (put by another client if homes differ); A decodes.
    tokens["b"] = doc[: 5 * C] + [rng.randrange(3, 900) for _ in range(30)]
    run_iteration(cluster, tokens, {"a": 1, "b": 11}, first_prefix={"b": 5 * C})
    for _ in range(C + 2):  # decode across a segment boundary: the tail seals
        run_iteration(cluster, tokens, {"a": 1, "b": 1})
    # Chunked prefill with DoP > 1 when there are instances to spread over.
    tokens["c"] = doc[: 2 * C] + [rng.randrange(3, 900) for _ in range(3 * C + 5)]
    dop = min(2, cluster.n_instances)
    run_iteration(cluster, tokens, {"c": 3 * C + 5}, dops=[dop], first_prefix={"c": 2 * C})
    for rid in ("a", "b", "c"):
        cluster.control.finish_request(rid)


def test_requests_sharing_a_document_decode_together_in_one_batch(cluster):
    """Three requests on one cached document, each with its own tail, decode in one
    sub-batch: the query engine attends the shared segments once for all their rows
    (cascade) and each tail on its own; every row equals the monolithic reference, also
    while the tails seal, and with a request whose prefix is the document alone."""
    rng = random.Random(300 + cluster.n_instances)
    doc = [rng.randrange(3, 900) for _ in range(4 * C)]
    tokens = {"d0": doc + [rng.randrange(3, 900) for _ in range(3 + 2 * C)]}
    run_iteration(cluster, tokens, {"d0": len(doc) + 3})
    for i, extra in ((1, 5), (2, 0)):
        tokens[f"d{i}"] = doc + [rng.randrange(3, 900) for _ in range(extra + 2 * C)]
    run_iteration(cluster, tokens, {"d1": 5, "d2": 1}, dops=[1], first_prefix={"d1": 4 * C, "d2": 4 * C})
    for _ in range(C + 1):  # decode together, across a segment boundary
        run_iteration(cluster, tokens, {"d0": 1, "d1": 1, "d2": 1}, dops=[1])
    for rid in ("d0", "d1", "d2"):
        cluster.control.finish_request(rid)


def test_puts_coalesced_over_all_layers_store_the_same(cluster):
    """One put for every layer (what decode sends) stores exactly what per-layer puts
    store, locally and on peers: later iterations read it back through queries."""
    rng = random.Random(100 + cluster.n_instances)
    tokens = {"p": [rng.randrange(3, 900) for _ in range(4 * C + 3 + C + 2)]}
    run_iteration(cluster, tokens, {"p": 4 * C + 3}, coalesce=True)  # segments go to their homes
    for _ in range(C + 2):  # coalesced decode puts into the tail, which seals
        run_iteration(cluster, tokens, {"p": 1}, coalesce=True)
    cluster.control.finish_request("p")


def test_put_of_a_layer_range_outside_the_model_is_refused(cluster):
    cp = cluster.control
    plans = cp.gen_plans([Batch((BatchRequest("lr", (1, 2, 3)),))], [1])
    try:
        client = cluster.client(plans.transfer_plans[0].home)
        client.init_transfer(plans.transfer_plans[0])
        with pytest.raises(PlanError):
            client.put(1, cluster.model.num_layers)
        with pytest.raises(PlanError):
            client.put(0, 0)
    finally:
        cp.abort(plans)


@pytest.mark.parametrize("bad", [1.7, True, "1", -1, 10**6])
def test_layer_indices_are_strict_ints(cluster, bad):
    """``query(1.7)`` used to mean layer 1 (issue #17, finding 5): a layer that is not an
    int in range is refused by the client, before anything is sent."""
    cp = cluster.control
    plans = cp.gen_plans([Batch((BatchRequest("ix", (1, 2, 3)),))], [1])
    try:
        client = cluster.client(plans.query_plans[0].home)
        client.init_query(plans.query_plans[0])
        client.init_transfer(plans.transfer_plans[0])
        with pytest.raises(PlanError, match="layer"):
            client.query_async(bad)
        with pytest.raises(PlanError, match="layer"):
            client.put(bad)
        with pytest.raises(PlanError, match="layers"):
            client.put(0, bad if bad != -1 else 0.5)
    finally:
        cp.abort(plans)


def test_replicated_segments_give_the_same_result(cluster):
    if cluster.n_instances == 1:
        pytest.skip("replication needs two instances")
    rng = random.Random(7)
    tokens = {"r": [rng.randrange(3, 900) for _ in range(4 * C + 2)]}
    run_iteration(cluster, tokens, {"r": 4 * C})
    cp = cluster.control
    keys = cp.get_prefix_tree().match(tokens["r"]).keys
    reps = []
    for key in keys:  # copy every segment to an instance that lacks it
        have = {loc.instance for loc in cp.get_prefix_tree().replicas(key)}
        target = next(i for i in range(cluster.n_instances) if i not in have)
        reps.append(cp.start_replication(key, target))
    served = _served_during(cluster, "transfer", range(cluster.n_instances), lambda: cluster.replicate(reps))
    for rep in reps:
        src, dst = cluster.slab(rep.source.instance)[rep.source.slot], cluster.slab(rep.target.instance)[rep.target.slot]
        assert torch.equal(src, dst)
    # a copy is asked of the source's transfer engine; it writes into a co-located target's
    # slab itself (share_slabs) or sends the segment to the target's transfer engine
    asked = {i: sum(r.source.instance == i for r in reps) + (0 if cluster.share_slabs else
                                                              sum(r.target.instance == i for r in reps))
             for i in range(cluster.n_instances)}
    assert served == asked
    tokens["s"] = tokens["r"][: 4 * C] + [5, 6, 7]
    run_iteration(cluster, tokens, {"s": 3}, first_prefix={"s": 4 * C})
    for rid in ("r", "s"):
        cp.finish_request(rid)


def test_two_clients_query_concurrently(cluster):
    if cluster.n_instances < 2:
        pytest.skip("needs two homes")
    rng = random.Random(11)
    tokens = {f"t{i}": [rng.randrange(3, 900) for _ in range(3 * C + 1)] for i in range(2)}
    run_iteration(cluster, tokens, {rid: len(t) for rid, t in tokens.items()})
    cp = cluster.control
    plans = cp.gen_plans([Batch((BatchRequest(rid, (9,)),), "decode") for rid in tokens], [1, 1])
    errors = []

    def work(qp):
        try:
            client = cluster.client(qp.home)
            q = client.init_query(qp)
            for _ in range(20):
                q.normal_()
                part = client.query(0)
                ref = reference_prefix(tokens[qp.spans[0].request_id], qp.spans[0].prefix_tokens, q.cpu(), 0,
                                       cluster.model, kv_dtype=getattr(torch, cluster.kv_dtype))
                assert (part.o.cpu().double() - ref[0]).abs().max() < (2e-2 if q.is_cuda else 1e-5)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    for qp in plans.query_plans:  # create clients before the threads share the context
        cluster.client(qp.home)
    threads = [threading.Thread(target=work, args=(qp,)) for qp in plans.query_plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    cp.abort(plans)
    for rid in tokens:
        cp.finish_request(rid)


def test_bad_input_gets_a_typed_error_and_the_engine_keeps_serving(cluster):
    from tokenlake.dataplane.messages.session import new_token

    inst = 0
    token = new_token()
    cluster.open_session(token, 900, inst)  # a member's session, as tokenlake.connect opens
    sock = cluster._dealer(("query", inst), as_owner=False, routing_id=token)
    try:
        sock.send_multipart([b"\xff\x00garbage", b"x"])  # malformed header
        reply = parse(wire.recv(sock, 5.0))
        assert isinstance(reply, ErrorReply) and reply.type == "WireError"
        bad_slot = RegisterQueryPlan(99, 1, (InstanceItems(inst, (AttendItem(0, 1, (10_000,), (C,)),)),))
        sock.send_multipart(bad_slot.encode(2))  # no grant: refused before it is read further
        with pytest.raises(NotAuthorized, match="grant"):
            wire.raise_if_error(wire.recv(sock, 5.0))
        granted = grants.sign(cluster.grant_key, token, 0, grants.QUERY_PLAN, grants.payload(bad_slot.body()))
        sock.send_multipart(replace(bad_slot, grant=granted).encode(2))  # granted, yet out of range
        reply = wire.recv(sock, 5.0)
        with pytest.raises(PlanError, match="slot"):
            wire.raise_if_error(reply)
        sock.send_multipart(Query(12345, 0).encode(3))
        with pytest.raises(PlanError, match="unknown plan"):
            wire.raise_if_error(wire.recv(sock, 5.0))
        # a body that does not fit its kind: a WireError naming the field, with the id
        sock.send_multipart(wire.encode(wire.Kind.QUERY, 5, {"plan": 1, "layer": "0"}))
        reply = wire.recv(sock, 5.0)
        assert reply.msg_id == 5
        with pytest.raises(WireError, match="QUERY: field 'layer' must be an int"):
            wire.raise_if_error(reply)
        # what a peer query looked like in protocol 1 is no peer query: the kind decides
        sock.send_multipart(wire.encode(wire.Kind.QUERY, 7, {"key": f"{inst}:1", "layer": 0}))
        with pytest.raises(WireError, match="QUERY: field 'plan' is missing"):
            wire.raise_if_error(wire.recv(sock, 5.0))
        peer_query = PeerQuery(inst, 1, 0, torch.zeros(1, TINY.num_q_heads, cluster.model.head_dim))
        sock.send_multipart(peer_query.encode(8))
        with pytest.raises(NotAuthorized):  # the peers' kinds come from engines only
            wire.raise_if_error(wire.recv(sock, 5.0))
        with pytest.raises(PlanError, match="unknown plan"):  # from an engine: read, and refused
            engine_request(cluster, ("query", inst), peer_query, PeerQueryResult)
        # a transfer engine's kind sent to a query engine is refused by name
        sock.send_multipart(Put(1, 0).encode(6))
        with pytest.raises(WireError, match="query engine cannot handle PUT"):
            wire.raise_if_error(wire.recv(sock, 5.0))
        sock.send_multipart(Ping().encode(4))
        assert expect(wire.recv(sock, 5.0), Pong).instance == inst
    finally:
        sock.close(0)
        cluster.close_session(token)


def test_killed_query_engine_becomes_engine_unavailable():
    with LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, timeout_s=30.0) as cluster:
        tokens = {"k": list(range(3, 3 + 3 * C + 2))}
        run_iteration(cluster, tokens, {"k": len(tokens["k"])})
        cp = cluster.control
        plans = cp.gen_plans([Batch((BatchRequest("k", (5,)),), "decode")], [1])
        qp = plans.query_plans[0]
        client = cluster.client(qp.home)
        client.init_query(qp)
        other = 1 - qp.home
        cluster.kill("query", qp.home)
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable):
            client.query(0)
        assert time.monotonic() - t0 < 5.0
        # A dead remote query engine: the home's engine fails the query within its peer timeout.
        assert cluster.alive("query", other)
        cp.abort(plans)


def test_a_segment_put_by_one_client_is_queried_by_another(cluster):
    if cluster.n_instances < 2:
        pytest.skip("needs two homes")
    rng = random.Random(3)
    doc = [rng.randrange(3, 900) for _ in range(3 * C)]
    tokens = {"w": doc + [1]}
    writer = run_iteration(cluster, tokens, {"w": len(doc)}).transfer_plans[0].home
    # A reader homed elsewhere: its query reads what the writer's client put.
    tokens["reader"] = doc + [rng.randrange(3, 900) for _ in range(2)]
    reader = (writer + 1) % cluster.n_instances
    plans = run_iteration(cluster, tokens, {"reader": 2}, first_prefix={"reader": 3 * C}, homes=[reader])
    assert plans.query_plans[0].home == reader
    for rid in ("reader", "w"):
        cluster.control.finish_request(rid)


def test_migration_moves_a_segment_and_queries_stay_exact(cluster):
    if cluster.n_instances < 2:
        pytest.skip("migration needs two instances")
    rng = random.Random(5)
    tokens = {"m": [rng.randrange(3, 900) for _ in range(2 * C + 1)]}
    run_iteration(cluster, tokens, {"m": 2 * C})
    cp = cluster.control
    tree = cp.get_prefix_tree()
    key = tree.match(tokens["m"]).keys[0]
    (src,) = tree.replicas(key)
    before = cluster.slab(src.instance)[src.slot].clone()
    target = (src.instance + 1) % cluster.n_instances
    cluster.migrate(key, target)
    (dst,) = tree.replicas(key)
    assert dst.instance == target and torch.equal(cluster.slab(target)[dst.slot], before)
    run_iteration(cluster, tokens, {"m": 1})  # the decode step reads the moved segment
    cp.finish_request("m")


def test_the_compute_engine_side_copies_nothing(cluster):
    """q rows reach the home query engine and results come back through shared memory:
    the client decodes no tensor frame, so it copies no byte (CopyStats)."""
    rng = random.Random(9)
    tokens = {"z": [rng.randrange(3, 900) for _ in range(4 * C + 1)]}
    CopyStats.reset()
    run_iteration(cluster, tokens, {"z": 4 * C})
    run_iteration(cluster, tokens, {"z": 1})
    assert CopyStats.bytes_copied == 0
    stats = cluster.engine_stats()
    assert {k for k in stats} == {(r, i) for r in ("query", "transfer") for i in range(cluster.n_instances)}
    assert all((pong.role, pong.instance) == key for key, pong in stats.items())
    cluster.control.finish_request("z")


def test_killed_remote_query_engine_fails_the_query_within_seconds():
    """Remote shares by message (as between hosts): a peer that died fails the query."""
    with LocalCluster(3, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, timeout_s=30.0,
                      peer_timeout_s=2.0, share_slabs=False) as cluster:
        rng = random.Random(1)
        tokens = {"r": [rng.randrange(3, 900) for _ in range(6 * C)]}
        run_iteration(cluster, tokens, {"r": 6 * C})
        cp = cluster.control
        plans = cp.gen_plans([Batch((BatchRequest("r", (5,)),), "decode")], [1])
        qp = plans.query_plans[0]
        remote = [t.instance for t in qp.tasks if t.instance != qp.home]
        assert remote, "the prefix should span instances"
        client = cluster.client(qp.home)
        client.init_query(qp)
        client.query(0)  # healthy first
        cluster.kill("query", remote[0])
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable) as failed:
            client.query(0)
        assert time.monotonic() - t0 < 5.0
        # the error names who did not answer (issue #17, finding 6)
        assert f"query engine of instance {remote[0]}" in str(failed.value)
        assert cluster.alive("query", qp.home)  # the home engine survived and still answers
        assert cluster.engine_stats()[("query", qp.home)].instance == qp.home
        cp.abort(plans)
        lost = cp.remove_instance(remote[0])
        assert "r" in lost
        cp.finish_request("r")


def _served_during(cluster, role, instances, action) -> dict[int, int]:
    """Requests each ``role`` engine of ``instances`` served while ``action()`` ran, the
    stats' own pings taken out (measured by asking for the stats twice beforehand)."""
    def requests():
        return {i: cluster.engine_stats()[(role, i)].requests for i in instances}

    idle, before = requests(), requests()
    action()
    after = requests()
    return {i: (after[i] - before[i]) - (before[i] - idle[i]) for i in instances}


def _spread_decode(cluster, rid):
    """A request whose cached prefix spans instances, its decode plan registered; returns
    (plans, query plan, the instances other than the home holding part of it, client,
    its q buffer)."""
    rng = random.Random(7)
    tokens = {rid: [rng.randrange(3, 900) for _ in range(6 * C)]}
    run_iteration(cluster, tokens, {rid: 6 * C})
    plans = cluster.control.gen_plans([Batch((BatchRequest(rid, (5,)),), "decode")], [1])
    qp = plans.query_plans[0]
    remote = sorted({t.instance for t in qp.tasks} - {qp.home})
    assert remote, "the prefix should span instances"
    client = cluster.client(qp.home)
    return plans, qp, remote, client, client.init_query(qp)


def test_shared_slabs_answer_remote_shares_without_asking_the_peers():
    """On one machine (share_slabs, the default) the home attends the peers' slots in
    their slabs itself: the peers' query engines serve no message for it, and the result
    equals the one computed by asking them (same q, bit for bit up to the merge order)."""
    answers = {}
    for share in (True, False):
        with LocalCluster(3, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, share_slabs=share) as cluster:
            plans, qp, remote, client, q_buf = _spread_decode(cluster, "s")
            q_buf[:1] = torch.randn(1, TINY.num_q_heads, TINY.head_dim, generator=torch.Generator().manual_seed(3))
            answers[share] = []
            served = _served_during(cluster, "query", remote, lambda client=client, out=answers[share]: out.extend(
                tuple(t.clone() for t in client.query(layer)) for layer in range(TINY.num_layers)))
            assert served == {i: 0 if share else TINY.num_layers for i in remote}, served
            cluster.control.abort(plans)
            cluster.control.finish_request("s")
    for (o, lse), (mo, mlse) in zip(answers[True], answers[False], strict=True):
        torch.testing.assert_close(o, mo, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse, mlse, rtol=0, atol=1e-6)


def test_shared_slabs_keep_answering_when_a_peer_query_engine_dies():
    """With shared slabs a dead peer query engine is not in a query's path: its slab is
    the launcher's memory and the plan's leases keep the slots, so the answer stays the
    same; the watcher still reports the instance failed, and it leaves the pool."""
    with LocalCluster(3, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, timeout_s=30.0) as cluster:
        plans, qp, remote, client, q_buf = _spread_decode(cluster, "k")
        q_buf[:1] = torch.randn(1, TINY.num_q_heads, TINY.head_dim)
        o, lse = (t.clone() for t in client.query(1))
        cluster.kill("query", remote[0])
        o2, lse2 = client.query(1)
        assert torch.equal(o, o2) and torch.equal(lse, lse2)
        assert cluster.failed_instances() == [remote[0]]
        cluster.control.abort(plans)
        assert "k" in cluster.remove_instance(remote[0])
        cluster.control.finish_request("k")


def test_a_plan_over_a_removed_co_located_instance_fails_instead_of_reading_its_slab():
    """A plan registered before a co-located peer left must not read that peer's slab
    (a restart zeroes it): the query is an EngineUnavailable naming the instance."""
    with LocalCluster(3, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, timeout_s=30.0) as cluster:
        plans, qp, remote, client, q_buf = _spread_decode(cluster, "g")
        q_buf[:1] = torch.randn(1, TINY.num_q_heads, TINY.head_dim)
        client.query(0)
        cluster.control.abort(plans)
        assert "g" in cluster.remove_instance(remote[0])
        with pytest.raises(EngineUnavailable, match=f"instance {remote[0]} left the cluster"):
            client.query(0)
        cluster.control.finish_request("g")


def test_client_tables_stay_flat_over_many_iterations(cluster):
    """Plans registered and released and puts waited for one by one, as documented, for
    2,000 iterations: the client keeps no reply, no handle and no id per iteration
    (issue #17, finding 9)."""
    cp = cluster.control
    plans = cp.gen_plans([Batch((BatchRequest("flat", (1, 2, 3)),))], [1])
    try:
        qp, tp = plans.query_plans[0], plans.transfer_plans[0]
        client = cluster.client(qp.home)
        sizes = []
        for i in range(2000):
            if i % 50 == 0:  # a new plan now and then: the old one is released
                client.init_query(qp)
                client.init_transfer(tp)
            client.put(0).wait()
            client.query(0)
            sizes.append(len(client._replies) + len(client._puts) + len(client._unawaited))
        client.wait_puts()
        # at most the two releases still in flight (their replies are read with the next
        # message: the per-layer hand-offs through the bell need none) and the last put
        assert max(sizes[100:]) <= 3, max(sizes[100:])
    finally:
        cp.abort(plans)


# --------------------------------------------------------------- page hits (issue #19)


@pytest.fixture(scope="module")
def paged():
    with LocalCluster(3, TINY, POOL_BYTES, segment_tokens=C, max_rows=256, page_tokens=2) as c:
        yield c


def test_a_page_hit_and_the_tail_it_copies_are_attended_exactly(paged):
    """B shares A's first segment and 4 tokens (2 pages) of its second: its first
    iteration reads those in place, later ones read its own tail, which the page copy
    filled; every query equals attention over B's own tokens (run_iteration checks)."""
    rng = random.Random(11)
    a = [rng.randrange(3, 900) for _ in range(3 * C)]
    b = a[: C + 4] + [rng.randrange(3, 900) for _ in range(C)]
    tokens = {"pa": a, "pb": b}
    run_iteration(paged, tokens, {"pa": 3 * C})
    paged.control.finish_request("pa")
    hit = paged.control.get_prefix_tree().match(b, max_tokens=len(b) - 1).hit_tokens
    assert hit == C + 4
    plans = run_iteration(paged, tokens, {"pb": 2}, first_prefix={"pb": hit})
    assert [c.tokens for tp in plans.transfer_plans for c in tp.copies] == [4]
    for _ in range(C - 2):  # decode over the copied pages; the tail seals on the way
        run_iteration(paged, tokens, {"pb": 1})
    paged.control.finish_request("pb")
    paged.control.check()


@pytest.mark.parametrize("src,dst", [(0, 1), (1, 2), (1, 1)])
def test_a_page_copy_reaches_another_instance_in_every_layer(paged, src, dst):
    """Copies between slots the control plane does not hand out (the last two): from the
    home (0 -> 1), between two peers (1 -> 2: the source sends the rows on) and on one
    peer (1 -> 1); the first 5 tokens of every layer arrive, the rest is untouched."""
    from tokenlake.core.plans import PageCopy, PutItem, TransferPlan

    last = paged.slots_per_instance - 1
    s_src, s_dst = (last, last - 1) if src == dst else (last, last)
    paged.slab(src)[s_src].copy_(torch.randn_like(paged.slab(src)[s_src]))
    paged.slab(dst)[s_dst].zero_()
    put = PutItem(0, last - 1, 0, 0, 1, None)  # a plan needs a row; a free slot takes it
    tp = TransferPlan(0, 0, 0, 1, (put,), 0, (PageCopy(src, s_src, dst, s_dst, 5),))
    client = paged.client(0)
    client.init_transfer(tp)
    client.put(0, TINY.num_layers).wait()
    got, want = paged.slab(dst)[s_dst], paged.slab(src)[s_src]
    assert torch.equal(got[..., :5, :], want[..., :5, :])
    assert not got[..., 5:, :].any()


def test_a_plans_layout_attends_slots_read_alike_once_for_all_their_rows():
    """What the query engine works out once per plan (``AttendLayout``): items of several
    row ranges over the same slots become one shared call for all those rows (cascade);
    each range's other items stay its own; with the cascade off (one call per row range), all are own."""
    from tokenlake.dataplane.attend_layout import AttendLayout

    doc0, doc1 = AttendItem(0, 1, (4, 5), (C, C)), AttendItem(1, 2, (4, 5), (C, C))
    tail0, tail1, doc2 = AttendItem(0, 1, (9,), (3,)), AttendItem(1, 2, (8,), (5,)), AttendItem(2, 4, (4, 5), (C, C))
    layout = AttendLayout.of({2: (doc0, tail0, doc1, tail1, doc2), 0: (AttendItem(0, 1, (1,), (C,)),)})
    assert layout.insts == (2, 0) and layout.stop == 4 and layout.disjoint
    ((rows, work),) = layout.shared
    assert rows == slice(0, 4) and work == ((0, 0), (4, 5), (C, C))  # contiguous rows: a slice
    gap = AttendLayout.of({2: (doc0, AttendItem(3, 4, (4, 5), (C, C)))})
    assert gap.shared[0][0].tolist() == [0, 3]  # rows with a gap: indices
    assert sorted(layout.own) == [(0, 1, ((0, 1), (9, 1), (3, C))), (1, 2, ((0,), (8,), (5,)))]
    flat = AttendLayout.of({2: (doc0, tail0, doc1)}, cascade=False)
    assert not flat.shared and sorted(flat.own) == [(0, 1, ((0, 0, 0), (4, 5, 9), (C, C, 3))),
                                                    (1, 2, ((0, 0), (4, 5), (C, C)))]


def test_init_plans_registers_both_and_keeps_the_one_taken_when_the_other_fails(cluster, monkeypatch):
    """Both registrations are sent before either reply is read. If the query plan's is
    refused, the transfer plan is still the client's (its put is stored) and the query
    plan before it is kept; the refusal is raised."""
    cp = cluster.control
    plans = cp.gen_plans([Batch((BatchRequest("ip", (1, 2, 3)),))], [1])
    try:
        qp, tp = plans.query_plans[0], plans.transfer_plans[0]
        client = cluster.client(qp.home)
        before = client._query_plan
        events, real_wait, real_send = [], client._wait, client._send

        def send(role, message):
            events.append(("send", type(message).__name__))
            return real_send(role, message)

        def refuse_first(msg_id, timeout_s, reply):
            events.append(("wait", msg_id))
            got = real_wait(msg_id, timeout_s, reply)
            if len(events) == 3:
                raise PlanError("refused for the test")
            return got

        monkeypatch.setattr(client, "_send", send)
        monkeypatch.setattr(client, "_wait", refuse_first)
        with pytest.raises(PlanError, match="refused for the test"):
            client.init_plans(qp, tp)
        kinds = [e[0] if e[0] == "wait" else e[1] for e in events]
        assert kinds[:4] == ["RegisterQueryPlan", "RegisterTransferPlan", "wait", "wait"]
        assert client._query_plan is before
        assert client._transfer_plan[1] == tp.num_rows
        monkeypatch.undo()
        client.kv[0, : tp.num_rows].normal_()
        client.put(0).wait(10)
        q_buf, kv_buf = client.init_plans(qp, tp)
        assert q_buf.shape[0] == qp.num_rows and kv_buf.shape[1] == tp.num_rows
        taken, sends = client._query_plan, []
        monkeypatch.setattr(client, "_send", lambda role, message: sends.append(message))
        with pytest.raises(PlanError, match="homed on instance"):  # nothing sent at all
            client.init_plans(qp, replace(tp, home=tp.home + 1))
        assert sends == [] and client._query_plan is taken
    finally:
        cp.abort(plans)


def test_init_plans_without_waiting_reads_its_replies_at_the_first_use(cluster, monkeypatch):
    """``wait=False``: both registrations are sent and nothing is read until the first
    put, query or wait_puts, which takes the plans (or raises the refusal then); one
    that nobody used does not fail the next registration."""
    cp = cluster.control
    plans = cp.gen_plans([Batch((BatchRequest("nw", (4, 5, 6)),))], [1])
    try:
        qp, tp = plans.query_plans[0], plans.transfer_plans[0]
        client = cluster.client(qp.home)
        waits, real_wait = [], client._wait
        monkeypatch.setattr(client, "_wait", lambda *a: waits.append(a[0]) or real_wait(*a))
        q_buf, kv_buf = client.init_plans(qp, tp, wait=False)
        assert waits == [] and q_buf.shape[0] == qp.num_rows and kv_buf.shape[1] == tp.num_rows
        kv_buf[0].normal_()
        client.put(0).wait(10)  # reads both replies first
        assert len(waits) >= 2 and client._transfer_plan[1] == tp.num_rows
        assert client._query_plan[1].o.shape[0] == qp.num_rows
        taken = client._transfer_plan
        client.init_plans(None, replace(tp, num_rows=client.kv.shape[1] + 1), wait=False)  # refused by the engine
        with pytest.raises(PlanError):
            client.put(0)
        assert client._transfer_plan is taken  # the refused one never became current
        client.init_plans(None, replace(tp, num_rows=client.kv.shape[1] + 1), wait=False)  # refused, never used ...
        client.init_plans(None, tp, wait=False)  # ... does not fail this one
        client.wait_puts(10)
        assert client._transfer_plan is not taken and client._transfer_plan[1] == tp.num_rows
    finally:
        cp.abort(plans)

"""A query engine keeps serving after a bad PEERS message and after a peer's answer it
cannot use (issue #17, finding 2): the bad PEERS is refused and the old peers stay; the
unusable answer fails that one query with a typed error, written nowhere."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import zmq
from dataplane_util import TINY, engine_request, execute
from test_dataplane import POOL_BYTES, C, run_iteration

from tokenlake.core.errors import ConfigError, TokenLakeError
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.dataplane import messages
from tokenlake.dataplane.messages import Ack, PeerQuery, PeerQueryResult, Peers
from tokenlake.deploy.local import LocalCluster


@pytest.fixture(scope="module")
def cluster():
    # peers asked by message (as between hosts): the faults here are in their answers
    with LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=256, share_slabs=False) as c:
        yield c


def _prefix_run(cluster, tag: str):
    """Stores a 5-segment document, then queries a request reusing it (parts on both
    instances); returns the second iteration's thunk."""
    rng = random.Random(tag)
    doc = [rng.randrange(3, 900) for _ in range(5 * C)]
    tokens = {f"{tag}a": doc + [rng.randrange(3, 900) for _ in range(3)]}
    run_iteration(cluster, tokens, {f"{tag}a": len(doc) + 3})
    tokens[f"{tag}b"] = doc + [rng.randrange(3, 900) for _ in range(4)]
    return lambda: run_iteration(cluster, tokens, {f"{tag}b": 4}, first_prefix={f"{tag}b": 5 * C})


def _finish(cluster, *rids):
    for rid in rids:
        if rid in cluster.control.live_requests:
            cluster.control.finish_request(rid)


def test_a_bad_peers_message_is_refused_and_the_old_peers_stay(cluster):
    with pytest.raises(ConfigError, match="bad peer endpoint"):
        cluster._request(("query", 0), Peers(((1, "tcp://127.0.0.1:notaport"),)), Ack)
    second = _prefix_run(cluster, "p")
    second()  # the old peer of instance 0 still answers: results equal the reference
    _finish(cluster, "pa", "pb")


class FakePeer:
    """A ROUTER that answers every peer query with an (o, lse) of the wrong shape: a peer
    that holds the cluster's server key (``keys``), whose answers are still not trusted."""

    def __init__(self, keys=None) -> None:
        from tokenlake.dataplane.auth import serve_secure

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        serve_secure(self.sock, keys)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.stop, self.answered = threading.Event(), 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *payload = self.sock.recv_multipart()
            msg_id, message = messages.decode(payload)
            if isinstance(message, PeerQuery):
                answer = PeerQueryResult(message.layer, torch.zeros(1, 1, 1), torch.zeros(1, 1))
                self.answered += 1
            else:  # plan registrations and the like
                answer = Ack()
            self.sock.send_multipart([identity, *answer.encode(msg_id)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.sock.close(0)
        self.ctx.term()


def test_an_unusable_peer_answer_fails_one_query_and_the_engine_serves_on(cluster):
    rng = random.Random(11)
    doc = [rng.randrange(3, 900) for _ in range(5 * C)]
    tokens = {"fa": doc + [rng.randrange(3, 900) for _ in range(3)]}
    run_iteration(cluster, tokens, {"fa": len(doc) + 3})
    tokens["fb"] = doc + [rng.randrange(3, 900) for _ in range(4)]
    cp = cluster.control
    fake = FakePeer(cluster.keys)
    real = {i: cluster._endpoints[("query", i)] for i in (0, 1)}
    try:
        for me, other in ((0, 1), (1, 0)):  # every cross-instance query goes to the fake
            cluster._request(("query", me), Peers(((other, fake.endpoint),)), Ack)
        plans = cp.gen_plans([Batch((BatchRequest("fb", tuple(tokens["fb"][5 * C:]),
                                                  tuple(doc)),))], [1])
        try:
            with pytest.raises(TokenLakeError, match="answered layer|could not be used"):
                execute(cluster, plans, tokens, {"fb": 4})
        finally:
            cp.abort(plans)
        assert fake.answered > 0
    finally:
        for me, other in ((0, 1), (1, 0)):
            cluster._request(("query", me), Peers(((other, real[other]),)), Ack)
        fake.close()
    # the same query with the real peers: the engines serve on, results equal the reference
    run_iteration(cluster, tokens, {"fb": 4}, first_prefix={"fb": 5 * C})
    _finish(cluster, "fa", "fb")


def test_rejected_messages_log_one_line_at_a_time(caplog):
    import logging

    from tokenlake.engines.loop import RateLimitedLog

    clock = iter([0.0, 0.1, 0.2, 0.3, 1.5, 1.6])
    limited = RateLimitedLog(logging.getLogger("test.rate"), every_s=1.0,
                             clock=lambda: next(clock))
    with caplog.at_level(logging.WARNING, logger="test.rate"):
        for i in range(6):
            limited.note(f"bad {i}")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bad 0", "bad 4 (and 3 more since the last line)"]
    assert all("Traceback" not in (r.exc_text or "") for r in caplog.records)


def test_an_unexpected_failure_is_answered_with_a_typed_error(cluster):
    """A request no check caught (here: a peer plan for a layer table that is not a list)
    is answered with the project's WireError, never a raw Python exception name."""
    from tokenlake.dataplane import wire
    from tokenlake.dataplane.wire import Kind

    sock = cluster._dealer(("query", 0))
    try:
        sock.send_multipart(wire.encode(Kind.QUERY, 7, {"plan": [1], "layer": 0}))
        reply = wire.recv(sock, 10)
    finally:
        sock.close(0)
    assert reply.kind == Kind.ERROR
    assert reply.body["type"] in {"WireError", "PlanError", "ConfigError"}


# ---------------------------------------------------------------- bounded work (finding 4)


def _item(slots, start=0, stop=1):
    from tokenlake.dataplane.messages.query import AttendItem

    return AttendItem(start, stop, tuple(slots), tuple(1 for _ in slots))


def test_a_plan_naming_a_slot_many_times_is_refused(cluster):
    """A 20,000-fold repeat of one slot used to block the engine for ~10 s per query."""
    from tokenlake.core.errors import PlanError
    from tokenlake.dataplane.messages import PlanAck
    from tokenlake.dataplane.messages.query import PeerRegisterPlan

    with pytest.raises(PlanError, match="slot twice"):
        engine_request(cluster, ("query", 0), PeerRegisterPlan(1, 900, (_item([0] * 20000),)), PlanAck)
    rows, slots = cluster.max_rows, cluster.control.stats().pool.slots_capacity[0]
    every = _item(range(slots), 0, rows)  # every row over every slot: the most there is
    engine_request(cluster, ("query", 0), PeerRegisterPlan(1, 901, (every,)), PlanAck)
    with pytest.raises(PlanError, match="row-slot reads"):
        engine_request(cluster, ("query", 0), PeerRegisterPlan(1, 902, (every, every)), PlanAck)


def test_a_read_naming_a_slot_twice_is_refused(cluster):
    from tokenlake.core.errors import PlanError
    from tokenlake.dataplane.messages import SegmentData
    from tokenlake.dataplane.messages.transfer import ReadSegment

    with pytest.raises(PlanError, match="slot twice"):
        cluster._request(("transfer", 0), ReadSegment(0, (1,) * 60000), SegmentData)


def test_peer_plans_are_bounded_per_home(cluster):
    """Registrations that are never released stay bounded: the oldest is dropped."""
    from tokenlake.core.errors import PlanError
    from tokenlake.dataplane.messages import PlanAck
    from tokenlake.dataplane.messages.query import PeerQuery, PeerRegisterPlan
    from tokenlake.engines.query import MAX_PEER_PLANS

    for pid in range(2000, 2000 + MAX_PEER_PLANS + 10):
        engine_request(cluster, ("query", 0), PeerRegisterPlan(1, pid, (_item([0]),)), PlanAck)
    q = torch.zeros(1, TINY.num_q_heads, TINY.head_dim)
    with pytest.raises(PlanError, match="unknown plan"):  # the oldest went
        engine_request(cluster, ("query", 0), PeerQuery(1, 2000, 0, q), PeerQueryResult)
    newest = engine_request(cluster, ("query", 0), PeerQuery(1, 2000 + MAX_PEER_PLANS + 9, 0, q),
                            PeerQueryResult)
    assert newest.o.shape == (1, TINY.num_q_heads, TINY.head_dim)


def test_an_oversized_message_is_dropped_and_the_engine_serves_on(cluster):
    from tokenlake.dataplane.messages import Ping, Pong

    sock = cluster._dealer(("query", 0))
    try:
        sock.send_multipart([b"x" * (40 << 20)])  # over the 16 MiB floor of a tiny model
        assert sock.poll(1000) == 0, "nothing is answered: the connection was dropped"
    finally:
        sock.close(0)
    assert cluster._request(("query", 0), Ping(), Pong).role == "query"


def test_a_failed_local_part_is_the_only_reply_and_late_peer_results_are_dropped(cluster):
    """Finding 3: the home's own part of a query fails while a peer still computes its
    part. The caller gets one ERROR; the peer's result, arriving after it, is dropped:
    no second reply, and the caller's output buffer is not written. The home engine
    here is a twin of instance ``home``'s query engine in this process (same buffers,
    same peers, keys of the cluster) whose local attention is made to fail."""
    from tokenlake.core.errors import PlanError
    from tokenlake.dataplane import wire
    from tokenlake.dataplane.messages import (
        ErrorReply,
        Ping,
        PlanAck,
        Pong,
        Query,
        RegisterQueryPlan,
    )
    from tokenlake.deploy.base import ENGINE_BUFFERS
    from tokenlake.engines.loop import EngineSpec
    from tokenlake.engines.query import QueryEngine

    rng = random.Random(21)
    doc = [rng.randrange(3, 900) for _ in range(6 * C)]
    tokens = {"la": doc + [3, 4]}
    run_iteration(cluster, tokens, {"la": len(doc) + 2})
    cp = cluster.control
    plans = cp.gen_plans([Batch((BatchRequest("lb", (5,), tuple(doc)),), "decode")], [1])
    twin = thread = None
    try:
        (qp,) = plans.query_plans
        home = qp.home
        assert any(t.instance != home for t in qp.tasks), "a part runs on the peer"
        spec = EngineSpec("query", home, cluster.cluster_id,
                          {n: cluster._specs[home][n] for n in ENGINE_BUFFERS["query"]},
                          keys=cluster.keys.engine_view().to_dict())
        twin = QueryEngine(spec)

        def failing_local_part(q, items, layer):
            raise PlanError("injected: the local part failed")

        twin._partial = failing_local_part
        twin.start()
        twin.connect_peers({i: cluster._endpoints[("query", i)] for i in (0, 1)})
        thread = threading.Thread(target=twin.serve, daemon=True)
        thread.start()
        out_o = cluster._buffers[(home, "out_o")]
        out_o.fill_(7.0)
        sock = cluster._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        from tokenlake.dataplane.auth import connect_secure

        connect_secure(sock, cluster.keys, as_owner=True)  # the owner's own client
        sock.connect(twin.endpoint)
        try:
            sock.send_multipart(RegisterQueryPlan.from_plan(424242, qp).encode(1))
            assert isinstance(messages.parse(wire.recv(sock, 5.0)), PlanAck)
            sock.send_multipart(Query(424242, 0).encode(2))
            reply = wire.recv(sock, 5.0)
            assert reply.msg_id == 2 and isinstance(messages.parse(reply), ErrorReply)
            deadline = time.monotonic() + 10.0
            while twin.peer_replies < 1:  # the peer's late result has been taken in
                assert time.monotonic() < deadline, "the peer never answered"
                time.sleep(0.005)
            assert not sock.poll(1000), "a second reply to the failed query"
            assert bool((out_o == 7.0).all()), "the output buffer was written after the error"
            sock.send_multipart(Ping().encode(3))  # and the engine serves on
            assert isinstance(messages.parse(wire.recv(sock, 5.0)), Pong)
        finally:
            sock.close(0)
    finally:
        if twin is not None:
            twin._stop = True
            if thread is not None:
                thread.join(10)
            twin.close()
        cp.abort(plans)
        _finish(cluster, "la")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_flood_of_peer_plans_is_bounded_and_memory_returns_to_its_baseline(cluster):
    """Finding 4: peer plan registrations used to be kept forever (+95 MB for 60 large
    ones). A peer (only engines may send peer plans) registers twice ``MAX_PEER_PLANS``
    plans in which every row reads every slot, then releases them, twice over. The
    engine keeps at most ``MAX_PEER_PLANS`` per home (the oldest go), so its memory peaks
    below what that many plans could take (two tuples of 8-byte references per slot
    entry, with room to spare; ``test_peer_plans_are_bounded_per_home`` shows the oldest
    going); after the first round (which grows the allocator's pools once) it returns to
    the same level in the second."""
    from tokenlake.dataplane import wire
    from tokenlake.dataplane.messages import PeerRegisterPlan, PeerReleasePlan, PlanAck
    from tokenlake.dataplane.messages.query import AttendItem
    from tokenlake.engines.query import MAX_PEER_PLANS

    pid = cluster._procs[("query", 1)].pid
    slots, rows = cluster.slots_per_instance, cluster.max_rows // 4  # a quarter: a faster test
    items = tuple(AttendItem(r, r + 1, tuple(range(slots)), (C,) * slots) for r in range(rows))
    sock = cluster._dealer(("query", 1), as_engine=True)  # only engines send peer plans
    # encoded once, sent in both rounds (encoding them took a third of the test's time)
    plans = [PeerRegisterPlan(0, 50_000 + plan, items).encode(plan + 1) for plan in range(2 * MAX_PEER_PLANS)]
    before, after, peaks = _rss_mib(pid), [], []
    try:
        for _ in range(2):
            for frames in plans:
                sock.send_multipart(frames)
                assert isinstance(messages.parse(wire.recv(sock, 30.0)), PlanAck)
            peaks.append(_rss_mib(pid))
            for plan in range(2 * MAX_PEER_PLANS):
                sock.send_multipart(PeerReleasePlan(0, 50_000 + plan).encode(plan + 1))
                assert isinstance(messages.parse(wire.recv(sock, 30.0)), PlanAck)
            after.append(_rss_mib(pid))
    finally:
        sock.close(0)
    entries = MAX_PEER_PLANS * rows * slots  # slot numbers held at the bound
    assert max(peaks) - before < 2 * (entries * 2 * 8) / 2**20 + 16, (before, peaks)
    assert max(after[1:]) - after[0] < 4.0, f"memory grows round after round: {after}"

"""Client sessions (issue #39): the server's session table with an injected clock, and
the engines' side of sessions on a real two-instance pool: two sessions may use the
same plan ids on one instance at once and each gets exact answers from its own buffers;
one cannot release or query another's plans; a sender without a session gets nothing;
the peer kinds come from engines only; a closed session is refused."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

import pytest
import torch
import zmq
from dataplane_util import TINY, ManualClock, engine_request, execute, reference_prefix, token_kv
from test_dataplane import POOL_BYTES, C, run_iteration

from tokenlake.core.errors import CapacityError, NotAuthorized, PlanError, SessionEnded
from tokenlake.core.plans import Batch, BatchRequest, QueryPlan
from tokenlake.dataplane import grants, wire
from tokenlake.dataplane.auth import ClusterKeys
from tokenlake.dataplane.client import InstanceClient
from tokenlake.dataplane.messages import (
    PeerPut,
    PlanAck,
    PutDone,
    Query,
    RegisterQueryPlan,
    RegisterTransferPlan,
    ReleasePlan,
    SlotWrite,
    expect,
)
from tokenlake.dataplane.messages.session import alias, new_token, session_of, token_for
from tokenlake.dataplane.shm import SharedTensor
from tokenlake.dataplane.shm_files import BufferSpec, cluster_prefix, list_buffers
from tokenlake.deploy.local import LocalCluster
from tokenlake.kernels.attention import Partial
from tokenlake.service.sessions import SessionTable

# ---------------------------------------------------------------- the session table


def test_sessions_open_join_leave_and_expire_by_the_clock():
    clock = ManualClock(100.0)
    table = SessionTable(clock, timeout_s=3.0, iteration_timeout_s=60.0, max_sessions=2)
    a, b = new_token(), token_for("shared secret")
    sa = table.open(a, 11, "a")
    sb = table.open(alias(b, 1), 12, "vllm-scheduler")
    assert table.open(alias(b, 2), 13, "vllm-worker") is sb  # the second process joins
    assert (sa.number, sb.number) == (1, 2) and len(table) == 2
    with pytest.raises(CapacityError):
        table.open(new_token(), 14, "c")
    with pytest.raises(ValueError):
        table.open(b"\x00abc", 15, "not a token")
    clock.now += 2.0
    table.get(alias(b, 2))  # any request touches the session
    clock.now += 2.0
    assert [(s.number, why.startswith("no heartbeat")) for s, why in table.expired()] == [(1, True)]
    sb.iterations[7] = clock.now
    table.get(b)
    clock.now += 2.9
    assert [s.number for s, _ in table.expired()] == [1]
    clock.now += 58.0  # silent too long now, and its iteration overdue
    table.get(b)
    assert [(s.number, "iteration" in why) for s, why in table.expired()] == [(1, False), (2, True)]
    assert not table.leave(sb, alias(b, 1)) and table.leave(sb, alias(b, 2))  # the last leaves
    table.remove(sa)
    with pytest.raises(SessionEnded):
        table.get(a)
    table.check()


def test_request_ids_live_in_the_session_namespace():
    table = SessionTable(ManualClock(100.0))
    s1, s2 = table.open(new_token(), 1, ""), table.open(new_token(), 2, "")
    assert table.internal(s1, "r1") != table.internal(s2, "r1")
    assert table.external(s2, table.internal(s2, "r1")) == "r1"
    assert session_of(alias(s1.token, 3)) == s1.token and session_of(b"x" * 16) is None
    s1.requests.add("2/r1")  # another session's name: the invariant check catches it
    with pytest.raises(AssertionError):
        table.check()


# ---------------------------------------------------------------- the engines' side


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=64) as c:
        prefix = cluster_prefix(c.cluster_id)
        yield c
    assert list_buffers(prefix) == []


class SessionView:
    """What ``execute`` needs of a cluster, for one session's clients."""

    numbers = itertools.count(500)

    def __init__(self, cluster, token: bytes) -> None:
        self.cluster, self.token, self.clients, self.maps = cluster, token, {}, []
        self.number = next(self.numbers)
        self.ctx = zmq.Context()

    def client(self, instance: int) -> InstanceClient:
        if instance not in self.clients:
            info = self.cluster.open_session(self.token, self.number, instance)
            bufs = {}
            for name, d in info["buffers"].items():
                self.maps.append(SharedTensor.attach(BufferSpec.from_dict(d)))
                bufs[name] = self.maps[-1].tensor
            keys = None if info["keys"] is None else ClusterKeys.from_dict(info["keys"])
            client = InstanceClient(instance, info["endpoints"], bufs, lambda: None, 5.0,
                                    keys=keys, routing_id=self.token, grant_for=self.grant_for)
            client.start(self.ctx)
            self.clients[instance] = client
        return self.clients[instance]

    def grant_for(self, plan) -> bytes:
        """The grant the control server would give this session for ``plan``."""
        if isinstance(plan, QueryPlan):
            kind, body = grants.QUERY_PLAN, RegisterQueryPlan.from_plan(0, plan).body()
        else:
            kind, body = grants.TRANSFER_PLAN, RegisterTransferPlan.from_plan(0, plan).body()
        return grants.sign(self.cluster.grant_key, self.token, 0, kind, grants.payload(body))

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.ctx.term()
        for m in self.maps:
            m.close()
        self.cluster.close_session(self.token)


def _stored(cluster, tag: str) -> list[int]:
    rng = random.Random(tag)
    doc = [rng.randrange(3, 900) for _ in range(3 * C + 2)]
    run_iteration(cluster, {tag: doc}, {tag: len(doc)})
    return doc


def _decode_plans(cluster, rid: str, token: int):
    return cluster.control.gen_plans([Batch((BatchRequest(rid, (token,)),), "decode")], [1], homes=[0])


def test_two_sessions_use_one_plan_id_on_one_instance_and_each_is_exact(cluster):
    docs = {rid: _stored(cluster, rid) for rid in ("sa", "sb")}
    a, b = SessionView(cluster, new_token()), SessionView(cluster, new_token())
    try:
        pa, pb = _decode_plans(cluster, "sa", 5), _decode_plans(cluster, "sb", 6)
        ca, cb = a.client(0), b.client(0)
        assert ca.q.data_ptr() != cb.q.data_ptr() != cluster.client(0).q.data_ptr()
        for view, client, plans in ((a, ca, pa), (b, cb, pb)):  # both register plan 1
            qp = plans.query_plans[0]
            client._wait(client._send("query", RegisterQueryPlan.from_plan(1, qp, view.grant_for(qp))), None, PlanAck)
            client._query_plan = (1, Partial(client.out_o[:1], client.out_lse[:1]))
        for layer in range(TINY.num_layers):  # interleaved: both plans live at once
            qa, qb = torch.randn(1, TINY.num_q_heads, TINY.head_dim), torch.randn(1, TINY.num_q_heads, TINY.head_dim)
            ca.q[:1], cb.q[:1] = qa, qb
            ha, hb = ca.query_async(layer), cb.query_async(layer)
            for h, q, rid in ((hb, qb, "sb"), (ha, qa, "sa")):
                part = h.wait()
                ro, rlse = reference_prefix(docs[rid], len(docs[rid]), q, layer)
                assert (part.o.double() - ro).abs().max() < 1e-5
                assert (part.lse.double() - rlse).abs().max() < 1e-5
        # b releases "plan 1" and asks for plan 2: a's plan 1 is untouched
        cb._wait(cb._send("query", ReleasePlan(1)), None, PlanAck)
        cb._wait(cb._send("query", ReleasePlan(2)), None, PlanAck)
        assert ca.query(0).lse.isfinite().all()
        with pytest.raises(PlanError, match="unknown plan"):
            cb._wait(cb._send("query", Query(1, 0)), None, PlanAck)
    finally:
        for p in ("pa", "pb"):
            if p in locals():
                cluster.control.abort(locals()[p])
        a.close()
        b.close()
        for rid in docs:
            cluster.control.finish_request(rid)


def test_sessions_store_through_their_own_buffers(cluster):
    """Two sessions prefill at once; each one's puts come from its own kv buffer."""
    a, b = SessionView(cluster, new_token()), SessionView(cluster, new_token())
    rng = random.Random(3)
    tokens = {rid: [rng.randrange(3, 900) for _ in range(2 * C + 3)] for rid in ("pa", "pb")}
    try:
        for view, rid in ((a, "pa"), (b, "pb")):
            plans = cluster.control.gen_plans([Batch((BatchRequest(rid, tuple(tokens[rid])),))], [1])
            execute(view, plans, tokens, {rid: len(tokens[rid])})
            cluster.control.complete(plans)
        for rid in tokens:  # read back by the owner's client: exactly what each session put
            run_iteration(cluster, {rid: tokens[rid] + [7]}, {rid: 1})
    finally:
        a.close()
        b.close()
        for rid in tokens:
            if rid in cluster.control.live_requests:
                cluster.control.finish_request(rid)


def test_a_sender_without_a_session_and_a_closed_session_get_nothing(cluster):
    from tokenlake.dataplane.messages import AttendItem, InstanceItems

    plan = RegisterQueryPlan(1, 1, (InstanceItems(0, (AttendItem(0, 1, (0,), (C,)),)),))
    with pytest.raises(NotAuthorized, match="session"):  # a member's own connection
        engine_request(cluster, ("query", 0), plan, PlanAck, as_owner=False)
    view = SessionView(cluster, new_token())
    view.client(0)
    with pytest.raises(NotAuthorized, match="grant"):  # a session, but no grant for it
        engine_request(cluster, ("query", 0), plan, PlanAck, as_owner=False,
                       routing_id=alias(view.token, 1))
    plan = dataclasses.replace(plan, grant=grants.sign(cluster.grant_key, view.token, 0, grants.QUERY_PLAN,
                                                       grants.payload(plan.body())))
    # its client holds the token's connection: a second socket of the session is an alias
    # (a fresh one: the engine may not have seen alias 1's socket close yet, and a ROUTER
    # takes one connection per routing id; reusing it once lost this request)
    assert engine_request(cluster, ("query", 0), plan, PlanAck, as_owner=False,
                          routing_id=alias(view.token, 2)).plan == 1
    view.close()  # the engines forget it: its token is nobody's now
    with pytest.raises(NotAuthorized):
        engine_request(cluster, ("query", 0), plan, PlanAck, as_owner=False,
                       routing_id=alias(view.token, 3))


def test_peer_kinds_come_from_engines_only(cluster):
    """Finding 4: a member's forged PEER_PUT overwrote a cached slot. Now it is refused
    before anything is written, from a session too; an engine's is stored."""
    slab = cluster.slab(1)
    before = slab[3].clone()
    rows = token_kv([5, 6], 0, 0)
    put = PeerPut(0, 1, (SlotWrite(3, 0, 2),), (rows,))
    view = SessionView(cluster, new_token())
    view.client(1)
    try:
        for who in ({"as_owner": False}, {"as_owner": False, "routing_id": alias(view.token, 1)}):
            with pytest.raises(NotAuthorized, match="only an engine"):
                engine_request(cluster, ("transfer", 1), put, PutDone, **who)
        assert torch.equal(slab[3], before)
        engine_request(cluster, ("transfer", 1), put, PutDone)  # another engine: stored
        assert torch.equal(slab[3, 0, :, :, :2], rows.permute(1, 2, 0, 3))
    finally:
        slab[3].copy_(before)
        view.close()


def test_a_session_s_buffers_must_match_the_instance_s(cluster):
    from tokenlake.dataplane.messages import Ack, OpenSession

    wrong = BufferSpec("tokenlake-0-nope-kv-0", (1, 2), "float32")
    with pytest.raises(PlanError, match="session buffer kv"):
        cluster._request(("transfer", 0), OpenSession(new_token(), {"kv": wrong}), Ack)
    with pytest.raises(NotAuthorized):  # only the owner opens sessions on engines
        engine_request(cluster, ("transfer", 0), OpenSession(new_token(), {"kv": wrong}), Ack,
                       as_owner=False)


def test_closing_a_session_waits_for_nothing_and_unlinks_its_buffers(cluster):
    view = SessionView(cluster, new_token())
    view.client(0)
    mine = f"-s{view.number}-"
    names = [n for n in list_buffers(cluster_prefix(cluster.cluster_id)) if mine in n]
    assert len(names) == 5  # q, out_o, out_lse, kv, bell
    fifos = [n for n in list_buffers(cluster_prefix(cluster.cluster_id), fifos=True) if mine in n]
    assert sorted(fifos) == sorted(names + [f"{n}.{r}" for n in names if "-bell-" in n
                                            for r in ("query", "transfer")])  # the engines' doorbells
    view.close()
    assert not [n for n in list_buffers(cluster_prefix(cluster.cluster_id), fifos=True) if mine in n]


def test_wire_error_request_ids_are_strings():
    frames = wire.encode(wire.Kind.ERROR, 1, {"type": "SegmentInFlight", "message": "m",
                                               "request_ids": [1]})
    with pytest.raises(wire.WireError):
        expect(wire.decode(frames), PlanAck)


def test_a_client_that_stops_heartbeating_is_ended_and_told_so(cluster):
    """The server ends a silent session by itself (its plans aborted, its request
    finished, its buffers unlinked); the client's next call raises ``SessionEnded``."""
    import tokenlake
    from tokenlake.service.server import ControlServer

    clock = ManualClock(1000.0)  # the sessions' time moves only when the test says so
    with ControlServer(cluster, session_timeout_s=0.6, heartbeat_s=0.2, clock=clock) as server:
        cp = tokenlake.connect(server.address, credentials=server.credentials(), label="silent")
        try:
            plans = cp.gen_plans([Batch((BatchRequest("quiet", tuple(range(40, 60))),))], [1])
            cp.client(plans.query_plans[0].home)
            number = cp.session.session
            assert f"{number}/quiet" in cluster.control.live_requests
            cp._stop_heartbeat()  # as a hung process: no more heartbeats
            clock.now += 1.0  # ... for longer than the session timeout
            deadline = time.monotonic() + 5.0
            while server.sessions.find(cp.token) is not None:
                assert time.monotonic() < deadline, "the silent session was never ended"
                time.sleep(0.02)
            assert server.sessions.ended == 1
            assert f"{number}/quiet" not in cluster.control.live_requests
            assert not [n for n in list_buffers(cluster_prefix(cluster.cluster_id)) if f"-s{number}-" in n]
            with pytest.raises(SessionEnded):
                cp.complete(plans)
        finally:
            cp.close()
    cluster.control.check()


def test_a_dead_engine_is_not_waited_for_when_grants_are_retired(caplog):
    """The control server retires a session's grants on its engines at every commit and
    closes its sessions on them: an engine whose process has ended is skipped at once
    (a look at the process, no message), not waited out for the driver's whole timeout,
    which would hold every other session's requests behind it; the live engines are
    still asked."""
    timeout_s = 30.0
    with LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, timeout_s=timeout_s) as c:
        view = SessionView(c, new_token())
        try:
            view.client(0), view.client(1)
            c.kill("query", 1)
            caplog.set_level("WARNING", logger="tokenlake.deploy.base")
            t0 = time.monotonic()
            c.retire(view.token, [0, 1], (7,))
            assert time.monotonic() - t0 < timeout_s / 3
            warned = [r.getMessage() for r in caplog.records if "retiring grants" in r.getMessage()]
            assert len(warned) == 1 and "query engine of instance 1" in warned[0], warned
        finally:
            t0 = time.monotonic()
            view.close()  # closes the session on every engine: the dead one is skipped too
            assert time.monotonic() - t0 < timeout_s / 3

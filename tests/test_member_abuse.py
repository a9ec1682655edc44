"""A member cannot hurt other members (issue #39, finding 4). A served two-instance pool;
a victim compute engine in another process runs iterations over a shared document
while an attacker holding the same member credentials (and a session of its own) tries
what used to work: flooding peer plans, releasing plans by guessed ids, overwriting a
cached slot, registering plans it was not granted or replaying its own after they were
spent, reading slots it did not lease. Each is refused or bounded, the document's slots
are unchanged, and every one of the victim's answers equals the float64 reference."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq
from dataplane_util import TINY, execute, token_kv
from service_util import control_served
from test_engine_faults import _rss_mib

import tokenlake
from tokenlake.core.errors import NotAuthorized, PlanError
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.dataplane import wire
from tokenlake.dataplane.auth import connect_secure
from tokenlake.dataplane.messages import (
    AttendItem,
    InstanceItems,
    PeerPut,
    PeerRegisterPlan,
    PlanAck,
    Put,
    PutDone,
    PutTarget,
    ReadSegment,
    RegisterQueryPlan,
    RegisterTransferPlan,
    ReleasePlan,
    SegmentData,
    SlotWrite,
    expect,
)
from tokenlake.dataplane.messages.session import alias

WORKER = Path(__file__).with_name("shared_pool_worker.py")
C = 16
POOL_BYTES = 96 * TINY.num_layers * 2 * TINY.num_kv_heads * C * TINY.head_dim * 4


@pytest.fixture(scope="module")
def served():
    with control_served(TINY, 2, POOL_BYTES, C, 128, "tokenlake") as served:
        yield served


class Attacker:
    """A member with a session of its own and raw sockets to the engines (aliases of its
    session's token, so the engines take them as the session's)."""

    def __init__(self, cluster, server) -> None:
        self.cluster = cluster
        self.cp = tokenlake.connect(server.address, label="attacker")
        self.cp.open_session()
        self.ctx = zmq.Context()
        self.socks: dict[tuple[str, int], zmq.Socket] = {}
        self.ids = 100
        for inst in (0, 1):
            self.cp.client(inst)  # the session's buffers there: the engines know its token

    def sock(self, role: str, inst: int, member_only: bool = False) -> zmq.Socket:
        key = (role if not member_only else role + "-member", inst)
        if key not in self.socks:
            s = self.socks[key] = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if not member_only:
                s.setsockopt(zmq.ROUTING_ID, alias(self.cp.token, 7))
            connect_secure(s, self.cluster.keys.member_view())
            s.connect(self.cluster._endpoints[(role, inst)])
        return self.socks[key]

    def ask(self, role: str, inst: int, message, reply, member_only: bool = False):
        sock = self.sock(role, inst, member_only)
        self.ids += 1
        sock.send_multipart(message.encode(self.ids))
        return expect(wire.recv(sock, 5.0), reply)

    def close(self) -> None:
        for s in self.socks.values():
            s.close(0)
        self.ctx.term()
        self.cp.close()


def _store_document(cluster) -> tuple[list[int], list[tuple[int, int]]]:
    """The owner stores a 4-segment document; returns it and its slots."""
    doc = [(37 * i + 11) % 900 + 3 for i in range(4 * C)]
    cp = cluster.control
    plans = cp.gen_plans([Batch((BatchRequest("doc", tuple(doc)),))], [1])
    execute(cluster, plans, {"doc": doc}, {"doc": len(doc)})
    cp.complete(plans)
    cp.finish_request("doc")
    match = cp.get_prefix_tree().match(doc)
    assert match.hit_tokens == len(doc)
    return doc, [(reps[0].instance, reps[0].slot) for reps in match.replicas]


def test_member_abuses_are_refused_and_the_victim_stays_exact(served):
    cluster, server = served
    doc, slots = _store_document(cluster)
    before = {s: cluster.slab(s[0])[s[1]].clone() for s in slots}
    spec = json.dumps(dataclasses.asdict(TINY))
    victim = subprocess.Popen([sys.executable, str(WORKER), server.address, spec, "3", "40"],
                              cwd=WORKER.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    att = Attacker(cluster, server)
    try:
        inst, slot = slots[0]
        # 1. peer plans with a fresh home each time: refused, and the engine's memory is flat
        rss = _rss_mib(cluster._procs[("query", inst)].pid)
        for home in range(400):
            item = AttendItem(0, 1, (slot,), (C,))
            with pytest.raises(NotAuthorized, match="only an engine"):
                att.ask("query", inst, PeerRegisterPlan(1000 + home, 1, (item,)), PlanAck, member_only=True)
        assert _rss_mib(cluster._procs[("query", inst)].pid) - rss < 8.0
        # 2. releasing plans by guessed small ids, on every engine, while the victim runs
        for pid in range(1, 60):
            for role in ("query", "transfer"):
                for i in (0, 1):
                    assert att.ask(role, i, ReleasePlan(pid), PlanAck).plan == pid  # its own: none
        # 3. PEER_PUT over a cached slot: refused (a member, and a session alike)
        rows = token_kv([5] * C, 0, 0)
        put = PeerPut(0, 1, (SlotWrite(slot, 0, C),), (rows,))
        for member_only in (True, False):
            with pytest.raises(NotAuthorized, match="only an engine"):
                att.ask("transfer", inst, put, PutDone, member_only=member_only)
        # 4. a transfer plan naming the document's slot: no grant, or another plan's grant
        forged = RegisterTransferPlan(1, C, (PutTarget(inst, slot, 0, 0, C),))
        with pytest.raises(NotAuthorized, match="grant"):
            att.ask("transfer", inst, forged, PlanAck)
        own = att.cp.gen_plans([Batch((BatchRequest("mine", tuple(range(500, 500 + C + 3))),))], [1])
        (tp,) = own.transfer_plans
        with pytest.raises(NotAuthorized, match="not one the control server granted"):
            att.ask("transfer", tp.home, dataclasses.replace(forged, grant=att.cp.grant_for(tp)), PlanAck)
        # ... its own granted plan registers, and is spent once the iteration completes
        mine = RegisterTransferPlan.from_plan(1, tp, att.cp.grant_for(tp))
        assert att.ask("transfer", tp.home, mine, PlanAck).plan == 1
        att.cp.abort(own)
        with pytest.raises(NotAuthorized, match="spent"):
            att.ask("transfer", tp.home, mine, PlanAck)
        with pytest.raises(PlanError, match="unknown transfer plan"):  # retired: it is gone
            att.ask("transfer", tp.home, Put(1, 0), PutDone)
        # 5. a query plan over the document's slots it was not granted: refused
        look = RegisterQueryPlan(3, 1, (InstanceItems(inst, (AttendItem(0, 1, (slot,), (C,)),)),))
        with pytest.raises(NotAuthorized, match="grant"):
            att.ask("query", inst, look, PlanAck)
        # 6. reads: not without a lease; with its lease, exactly those slots until it ends
        with pytest.raises(NotAuthorized, match="grant"):
            att.ask("transfer", inst, ReadSegment(0, (slot,)), SegmentData)
        locs = att.cp.lease_prefix("lease", doc[: 2 * C])
        here = tuple(loc.slot for loc in locs if loc.instance == locs[0].instance)
        grant = att.cp.read_grant("lease", locs[0].instance)
        got = att.ask("transfer", locs[0].instance, ReadSegment(0, here, grant), SegmentData)
        assert len(got.blocks) == len(here)
        wider = tuple(sorted(set(here) | {s for i, s in slots if i == locs[0].instance}))
        if wider != here:
            with pytest.raises(NotAuthorized):
                att.ask("transfer", locs[0].instance, ReadSegment(0, wider, grant), SegmentData)
        att.cp.finish_request("lease")
        with pytest.raises(NotAuthorized, match="spent"):
            att.ask("transfer", locs[0].instance, ReadSegment(0, here, grant), SegmentData)
    finally:
        att.close()
        out, err = victim.communicate(timeout=300)
    assert victim.returncode == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["iterations"] >= 40 and result["worst"] < 1e-5, result
    for s, data in before.items():  # nothing of the document was overwritten
        assert torch.equal(cluster.slab(s[0])[s[1]], data), s
    cluster.control.check()

"""Per-layer hand-offs through the sessions' bells in shared memory (dataplane/doorbell.py):
the pool on one host answers through them by default, exactly as by message; a bad entry
fails alone with its typed error; a silent engine is a deadline, a dead one
``EngineUnavailable`` as fast as on the socket path; a ring wraps; a session's puts are
served before its next message; a client that writes nonsense into its ring hangs
nothing; no FIFO outlives its pool."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time

import pytest
import torch
from dataplane_util import TINY, execute, query_rows, reference_prefix, token_kv
from test_dataplane import POOL_BYTES, C, run_iteration

from tokenlake.core.errors import EngineUnavailable, PlanError
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.dataplane import doorbell
from tokenlake.dataplane.messages import Ping, Pong
from tokenlake.dataplane.shm_files import cluster_prefix, list_buffers
from tokenlake.deploy.local import LocalCluster


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=256) as c:
        prefix = cluster_prefix(c.cluster_id)
        yield c
    assert list_buffers(prefix, fifos=True) == [], "a doorbell outlived its pool"


def _handoffs(cluster) -> dict:
    return {(role, i): cluster._request((role, i), Ping(), Pong).handoffs
            for role in ("query", "transfer") for i in range(cluster.n_instances)}


def _doc_plans(cluster, tag: str, rows: int = 3):
    """A 4-segment document stored, then ``rows`` one-token requests over it planned
    (their prefix on both instances); returns ``(plans, tokens)``."""
    rng = random.Random(tag)
    doc = [rng.randrange(3, 900) for _ in range(4 * C)]
    run_iteration(cluster, {f"{tag}-doc": doc}, {f"{tag}-doc": len(doc)})
    cluster.control.finish_request(f"{tag}-doc")
    tokens = {f"{tag}{i}": doc + [rng.randrange(3, 900)] for i in range(rows)}
    batch = Batch(tuple(BatchRequest(rid, (t[-1],), tuple(doc)) for rid, t in tokens.items()))
    return cluster.control.gen_plans([batch], [1]), tokens


def test_a_pool_on_one_host_hands_off_through_bells_and_answers_as_by_message(cluster):
    before = _handoffs(cluster)
    run_iteration(cluster, {"a": list(range(3, 3 + 3 * C + 5))}, {"a": 3 * C + 5})  # checks the answers
    after = _handoffs(cluster)
    home = next(i for i in range(2) if after[("query", i)] > before[("query", i)])
    assert after[("query", home)] - before[("query", home)] == TINY.num_layers  # one per layer
    assert after[("transfer", home)] - before[("transfer", home)] == TINY.num_layers
    plans, tokens = _doc_plans(cluster, "same")
    (qp,) = plans.query_plans
    client = cluster.client(qp.home)
    q = client.init_query(qp)
    try:
        for layer in range(TINY.num_layers):
            for span in qp.spans:
                q[span.start:span.stop] = query_rows(span.request_id, span.position, 1, layer)
            bell = client.query(layer)
            o, lse = bell.o.clone(), bell.lse.clone()
            client.fast = False  # the same layer by QUERY / QUERY_DONE
            try:
                sock = client.query(layer)
            finally:
                client.fast = True
            assert torch.equal(o, sock.o) and torch.equal(lse, sock.lse)  # bit for bit
            for span in qp.spans:
                ro, rlse = reference_prefix(tokens[span.request_id], 4 * C, q[span.start:span.stop], layer)
                assert (o[span.start:span.stop].double() - ro).abs().max() < 1e-5
                assert (lse[span.start:span.stop].double() - rlse).abs().max() < 1e-5
        assert client._bell is not None
    finally:
        cluster.control.abort(plans)


def _querying(cluster, tag: str):
    """``_doc_plans`` with its query plan registered on its home's client and one layer
    served (the bell is open then); returns ``(plans, client)``."""
    plans, _ = _doc_plans(cluster, tag)
    (qp,) = plans.query_plans
    client = cluster.client(qp.home)
    client.init_query(qp)
    client.query(0)
    return plans, client


def test_the_opt_in_spin_and_heads_up_answer_as_the_default_does(cluster, monkeypatch):
    """Spinning is off by default (``TOKENLAKE_BELL_SPIN_US``); turned on, the client
    spins on the done word first and the answers are bit for bit the same. A heads-up
    to an engine that does not spin is harmless."""
    assert doorbell.SPIN_S == 0.0 and not cluster.client(0).heads_up  # the defaults
    plans, client = _querying(cluster, "spin")
    try:
        plain = client.query(1)
        o, lse = plain.o.clone(), plain.lse.clone()
        monkeypatch.setattr(doorbell, "SPIN_S", 0.05)
        client._bell.spin = {role: True for role in doorbell.ROLES}
        client.heads_up = True
        client.expect_query()
        spun = client.query(1)
        assert torch.equal(o, spun.o) and torch.equal(lse, spun.lse)
        assert client._bell.spin["query"], "a short wait keeps the spin on"
    finally:
        client.heads_up = False
        cluster.control.abort(plans)


def test_a_bad_entry_fails_alone_with_its_typed_error(cluster):
    plans, client = _querying(cluster, "bad")
    try:
        bell = client._bell
        seq = bell.post("query", client._query_plan[0], TINY.num_layers + 3)  # no such layer
        with pytest.raises(PlanError, match="layer"):
            client._wait_bell("query", seq, 5.0)
        seq = bell.post("query", 987654, 0)  # no such plan
        with pytest.raises(PlanError, match="unknown plan 987654"):
            client._wait_bell("query", seq, 5.0)
        client.query(1)  # the next one is served
    finally:
        cluster.control.abort(plans)


def test_a_ring_wraps_and_a_sessions_puts_are_served_before_its_next_message(cluster):
    """More puts in flight than the ring has entries, then a new plan registered (which
    releases the old one by message) before any is waited for: every put is stored."""
    rid = "wrap"
    toks = list(range(5, 5 + C))
    cp = cluster.control
    plans = cp.gen_plans([Batch((BatchRequest(rid, tuple(toks)),))], [1])
    (_qp,), (tp,) = plans.query_plans, plans.transfer_plans
    client = cluster.client(tp.home)
    kv = client.init_transfer(tp)
    handles = []
    for _rnd in range(3 * doorbell.RING // TINY.num_layers + 1):  # > 3 rings of puts, none waited for
        for layer in range(TINY.num_layers):
            kv[layer, :C] = token_kv(toks, 0, layer)
            handles.append(client.put(layer))
    assert len(handles) > 2 * doorbell.RING
    client.init_transfer(tp)  # the old plan's release travels by message after the posts
    for h in handles:
        h.wait()
    cp.complete(plans)
    cp.finish_request(rid)
    # the stored segment is read back exactly
    again = cp.gen_plans([Batch((BatchRequest("wrap2", (9,), tuple(toks)),))], [1])
    results = execute(cluster, again, {"wrap2": toks + [9]}, {"wrap2": 1})
    cp.abort(again)
    for (_, _, layer), (q, o, _lse, span) in results.items():
        assert span.prefix_tokens == C
        ro, _ = reference_prefix(toks + [9], C, q, layer)
        assert (o.double() - ro).abs().max() < 1e-5


def test_nonsense_in_a_ring_hangs_nothing(cluster):
    """A client that sets its ring's counter far ahead without writing the entries: the
    engine skips what was never written, keeps serving, and serves the next entry
    written properly."""
    plans, client = _querying(cluster, "junk")
    try:
        bell = client._bell
        bell.w[doorbell._HEADER] += 10 ** 12  # posted far ahead, no entry written
        bell.engines["query"].ring()
        assert cluster._request(("query", client.instance), Ping(), Pong).role == "query"  # the loop runs
        client.fast = False
        try:
            client.query(1)  # by message, meanwhile
        finally:
            client.fast = True
        for layer in (1, 0, 1):
            seq = bell.post("query", client._query_plan[0], layer)  # written properly again
            client._wait_bell("query", seq, 5.0)
    finally:
        cluster.control.abort(plans)


def test_a_silent_engine_is_a_deadline_and_a_dead_one_unavailable_at_once(tmp_path):
    with LocalCluster(1, TINY, POOL_BYTES, segment_tokens=C, max_rows=64) as cl:
        toks = list(range(3, 3 + 2 * C))
        run_iteration(cl, {"d": toks}, {"d": len(toks)})
        cl.control.finish_request("d")
        plans = cl.control.gen_plans([Batch((BatchRequest("e", (7,), tuple(toks)),))], [1])
        client = cl.client(0)
        client.init_query(plans.query_plans[0])
        client.query(0)
        pid = cl._procs[("query", 0)].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(EngineUnavailable, match="within the timeout"):
                client.query(1, timeout_s=0.4)
            assert 0.4 <= time.monotonic() - t0 < 2.0
            seq = client._bell.post("query", client._query_plan[0], 2)  # posted to a stopped engine
            os.kill(pid, signal.SIGKILL)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable, match="not running"):
            client._bell.wait("query", seq, time.monotonic() + 30, 0.05, lambda: None, 0)
        assert time.monotonic() - t0 < 2.0  # the doorbell's reader is gone: no 30 s deadline
        with pytest.raises(EngineUnavailable, match="not running"):
            client._wait_bell("query", seq, 30.0)  # and the launcher's liveness check says so too
        assert time.monotonic() - t0 < 4.0
        cl.control.abort(plans)


def test_a_doorbell_is_a_fifo_or_nothing(tmp_path):
    """An engine never reads a file or a link planted where its FIFO goes, and a client
    never writes into one: a doorbell is a FIFO of this user's or nothing."""
    buf = torch.zeros(doorbell.BELL_BYTES, dtype=torch.uint8)
    base = str(tmp_path / "bell")
    (tmp_path / "bell.query").write_bytes(b"")
    with pytest.raises(FileExistsError):
        doorbell.EngineBell("query", buf, base)
    os.symlink(tmp_path / "elsewhere", tmp_path / "bell.transfer")
    os.mkfifo(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):
        doorbell.EngineBell("transfer", buf, base)
    ringer = doorbell._Ringer(str(tmp_path / "bell.query"))
    ringer.ring()
    assert ringer.fd < 0 and (tmp_path / "bell.query").read_bytes() == b""
    os.unlink(tmp_path / "bell.query")
    os.unlink(tmp_path / "bell.transfer")
    engine = doorbell.EngineBell("query", buf, base)  # a FIFO of its own: served
    client = doorbell.ClientBell.attach(buf)
    assert client is None  # the transfer engine has not opened the bell yet
    other = doorbell.EngineBell("transfer", buf, base)
    client = doorbell.ClientBell.attach(buf)
    seq = client.post("query", 7, 1)
    assert engine.take() == [(seq, 7, 1, 1)]
    engine.finish(seq)
    client.wait("query", seq, time.monotonic() + 5, 0.05, lambda: None, 0)
    for end in (client, engine, other):
        end.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"]

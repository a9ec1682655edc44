"""A pool outlives its control process (docs/design.md §4 "Restart"), with real
processes: the owner of a LocalCluster is killed with ``kill -9``; its engines wait
their grace; a new process adopts them, rebuilds the control plane from the slots'
records and answers exactly (float64 reference); half-stored segments are never adopted;
unadopted engines end with every buffer and the state file."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from dataplane_util import TINY, check_iteration, engine_request, tier_round_trip

from tokenlake.core.errors import AdoptionRefused, NotAuthorized
from tokenlake.dataplane import grants, pool_state, wire
from tokenlake.dataplane.messages import Ack, Adopt, ReadSegment, SegmentData, expect
from tokenlake.dataplane.messages.session import new_token
from tokenlake.dataplane.shm_files import (
    cluster_prefix,
    create_buffer,
    list_buffers,
    pid_alive,
    unlink_buffer,
)
from tokenlake.deploy.local import LocalCluster

C = 8
POOL_BYTES = 32 * TINY.num_layers * 2 * TINY.num_kv_heads * C * TINY.head_dim * 4  # 32 slots
TESTS = Path(__file__).resolve().parent

OWNER = textwrap.dedent("""
    import json, sys, threading
    sys.path.insert(0, {tests!r})
    from dataplane_util import TINY, execute, token_kv
    from tokenlake.core.plans import Batch, BatchRequest
    from tokenlake.deploy.local import LocalCluster

    if __name__ == "__main__":
        cluster = LocalCluster(2, TINY, {pool}, segment_tokens={c}, max_rows=64,
                               orphan_grace_s={grace}, state_file={state!r}, tier_bytes={tier})
        cluster.start()
        cluster.note_leftover({leftover!r})
        cp = cluster.control
        doc = {doc!r}
        plans = cp.gen_plans([Batch((BatchRequest("a", tuple(doc), ()),))], [1])
        execute(cluster, plans, {{"a": doc}}, {{"a": len(doc)}})
        cp.complete(plans)
        cp.finish_request("a")
        out = {{"pids": [p.pid for p in cluster._procs.values()], "cluster_id": cluster.cluster_id,
               "stored": [k.hex() for k in cp.pool.hasher.keys(doc)], "grant_key": cluster.grant_key.hex()}}
        if {mid_put}:  # a second document: its first layer put, never completed
            other = {other!r}
            plans = cp.gen_plans([Batch((BatchRequest("b", tuple(other), ()),))], [1])
            qp, tp = plans.query_plans[0], plans.transfer_plans[0]
            client = cluster.client(qp.home)
            kv = client.init_transfer(tp)
            for span in qp.spans:
                kv[0, span.start:span.stop] = token_kv(other[span.position:span.position + span.stop - span.start],
                                                       span.position, 0)
            client.put(0).wait()
            out["half"] = [k.hex() for k in cp.pool.hasher.keys(other)]
        print(json.dumps(out), flush=True)
        threading.Event().wait()  # until killed
""")


def _doc(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 900) for _ in range(n)]


def _owner(tmp_path, grace: float, mid_put: bool = False, tier: int = 0):
    """Starts an owner process (with a tier of ``tier`` bytes per instance in host
    memory); returns (process, what it printed, state file, leftover)."""
    state, leftover = tmp_path / "pool-1.json", tmp_path / "serve-1.json"
    leftover.write_text("{}")
    script = tmp_path / "owner.py"
    script.write_text(OWNER.format(tests=str(TESTS), pool=POOL_BYTES, c=C, grace=grace, state=str(state),
                                   leftover=str(leftover), doc=_doc(1, 5 * C + 3), mid_put=mid_put,
                                   other=_doc(2, 4 * C), tier=tier))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, "the owner process did not start its pool"
    return proc, json.loads(line), state, leftover


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()


def _reap(proc, started: dict) -> None:
    """The owner process and every engine it started: gone, whatever the test did."""
    if proc.poll() is None:
        _kill(proc)
    for pid in started["pids"]:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def _wait_gone(pids, prefix, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(map(pid_alive, pids)) or list_buffers(prefix, fifos=True):
        assert time.monotonic() < deadline, ([p for p in pids if pid_alive(p)], list_buffers(prefix, fifos=True))
        time.sleep(0.05)


def test_a_kill_during_a_put_adopts_whole_segments_only_and_answers_stay_exact(tmp_path):
    proc, started, state_file, leftover = _owner(tmp_path, grace=60, mid_put=True)
    prefix = cluster_prefix(started["cluster_id"])
    try:
        _kill(proc)
        assert all(map(pid_alive, started["pids"])), "the engines did not wait to be adopted"
        state = pool_state.read(state_file)
        before = list_buffers(prefix)
        with LocalCluster(1, TINY, POOL_BYTES, segment_tokens=C, max_rows=64):
            pass  # a cold start beside the waiting pool touches none of its buffers (sweep)
        assert list_buffers(prefix) == before
        cluster = LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, orphan_grace_s=60,
                               state_file=state_file)
        assert cluster.waiting(state)
        report = cluster.adopt(state)
        try:
            tree = cluster.control.get_prefix_tree()
            stored = [bytes.fromhex(k) for k in started["stored"]]
            half = [bytes.fromhex(k) for k in started["half"]]
            assert report.segments == len(stored) == 5 and not report.refused
            assert all(tree.is_ready(k) for k in stored)
            assert not any(k in tree for k in half), "a half-stored segment was adopted"
            doc, other = _doc(1, 5 * C + 3), _doc(2, 4 * C)
            tokens = {"q": doc[:5 * C] + _doc(3, 6), "b": other + _doc(4, 3)}
            hits = check_iteration(cluster, tokens, {"q": 6, "b": len(tokens["b"])}, {"q": 5 * C, "b": 0})
            assert hits == {"q": 5 * C, "b": 0}
            tokens["b2"] = other + _doc(5, 2)
            assert check_iteration(cluster, tokens, {"b2": 2}, {"b2": 4 * C}) == {"b2": 4 * C}
            assert pool_state.read(state_file)["owner_pid"] == os.getpid()
            _old_grants_are_refused(cluster, bytes.fromhex(started["grant_key"]), stored[0])
        finally:
            cluster.close()
        _wait_gone(started["pids"], prefix, 10)
        assert not state_file.exists() and not leftover.exists()
    finally:
        _reap(proc, started)


def test_a_new_control_process_adopts_the_copies_a_host_memory_tier_holds(tmp_path):
    """The owner of a pool with tiers in host memory is killed; the transfer engines
    keep their copies through the grace, and the new owner adopts them beside the
    slabs' records. The document, then pushed out of the slabs, comes back from the
    tiers, and every answer equals float64 attention."""
    tier = 128 * POOL_BYTES // 32  # 128 segments per instance
    proc, started, state_file, _ = _owner(tmp_path, grace=60, tier=tier)
    try:
        _kill(proc)
        cluster = LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, orphan_grace_s=60,
                               state_file=state_file, tier_bytes=tier)
        cluster.adopt(pool_state.read(state_file))
        try:
            cp = cluster.control
            stored = [bytes.fromhex(k) for k in started["stored"]]
            assert sum(cp.stats().pool.tier.held.values()) == len(stored), "the tiers' copies adopted"
            tier_round_trip(cluster, _doc(1, 5 * C + 3), C, 72)  # the slabs hold 64
        finally:
            cluster.close()
    finally:
        _reap(proc, started)


def _old_grants_are_refused(cluster, old_key: bytes, key: bytes) -> None:
    """A client session's read granted by the dead owner is refused by the adopted
    engines; the same read granted by the new owner is served."""
    loc = cluster.control.get_prefix_tree().replicas(key)[0]
    token = new_token()
    cluster.open_session(token, 7, loc.instance)
    sock = cluster._dealer(("transfer", loc.instance), as_owner=False, routing_id=token)
    try:
        for signer, ok in ((old_key, False), (cluster.grant_key, True)):
            grant = grants.sign(signer, token, grants.lease_grant_id(1), grants.READ,
                                grants.payload({"slots": [loc.slot]}))
            sock.send_multipart(ReadSegment(0, (loc.slot,), grant).encode(1))
            reply = wire.recv(sock, 5.0)
            if ok:
                assert isinstance(expect(reply, SegmentData), SegmentData)
            else:
                with pytest.raises(NotAuthorized):
                    expect(reply, SegmentData)
    finally:
        sock.close(0)
        cluster.close_session(token)


def test_engines_not_adopted_end_after_their_grace_with_every_buffer_and_file(tmp_path):
    grace = 3.0
    proc, started, state_file, leftover = _owner(tmp_path, grace=grace)
    prefix = cluster_prefix(started["cluster_id"])
    try:
        _kill(proc)
        killed = time.monotonic()
        assert all(map(pid_alive, started["pids"])) and list_buffers(prefix)
        _wait_gone(started["pids"], prefix, grace + 10)
        assert time.monotonic() - killed > grace / 2, "the engines did not wait"
        assert not state_file.exists() and not leftover.exists(), "files outlived the pool"
    finally:
        _reap(proc, started)


def test_a_waiting_pool_that_lost_an_engine_is_discarded_and_a_new_one_starts(tmp_path):
    from tokenlake.service.serve import _start_or_adopt

    proc, started, state_file, leftover = _owner(tmp_path, grace=60)
    prefix = cluster_prefix(started["cluster_id"])
    try:
        _kill(proc)
        os.kill(started["pids"][0], signal.SIGKILL)  # one engine did not survive
        state = pool_state.read(state_file)
        cluster = LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, orphan_grace_s=60,
                               state_file=state_file)
        try:
            _start_or_adopt(cluster, state, lambda line: None)
            assert cluster.adopted is None and len(cluster.control.get_prefix_tree()) == 0
            _wait_gone(started["pids"], prefix, 10)  # what was left of it: gone at once
            mine = pool_state.read(state_file)
            assert mine["cluster_id"] == cluster.cluster_id != started["cluster_id"]
            assert mine["keys"]["owner_secret"] != state["keys"]["owner_secret"], "the dead pool's keys"
            tokens = {"a": _doc(9, 2 * C + 1)}
            assert check_iteration(cluster, tokens, {"a": len(tokens["a"])}, {"a": 0}) == {"a": 0}
        finally:
            cluster.close()
        assert not state_file.exists()
    finally:
        _reap(proc, started)


@pytest.fixture
def served_pool(tmp_path):
    with LocalCluster(1, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, orphan_grace_s=30,
                      state_file=tmp_path / "pool-2.json") as cluster:
        yield cluster


def test_a_living_owners_pool_is_not_adopted(served_pool, tmp_path):
    state = pool_state.read(served_pool.state_file)
    assert state["owner_pid"] == os.getpid() and state["keys"]["owner_secret"]
    assert os.stat(served_pool.state_file).st_mode & 0o777 == 0o600
    with pytest.raises(NotAuthorized, match="alive"):  # an engine refuses another owner
        engine_request(served_pool, ("query", 0), Adopt(os.getpid() + 1), Ack, as_owner=True)
    with pytest.raises(NotAuthorized, match="owner"):  # ADOPT is the owner's kind
        engine_request(served_pool, ("query", 0), Adopt(os.getpid()), Ack, as_owner=False)
    # as if another live process served it (its engines are alive: this pool's)
    state["owner_pid"], state["owner_start"] = os.getppid(), pool_state.process_start(os.getppid())
    other = LocalCluster(1, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, state_file=tmp_path / "x.json")
    with pytest.raises(AdoptionRefused, match="still served"):
        other.waiting(state)
    state["owner_start"] = "1"  # the owner's pid was taken over by another process since
    assert other.waiting(state)
    state["settings"]["segment_tokens"] = 16
    with pytest.raises(AdoptionRefused, match="segment_tokens 16"):
        other.check_settings(state)


def test_a_sweep_keeps_the_buffers_of_a_cluster_a_live_process_maps(tmp_path):
    """Engines that wait to be adopted map their dead owner's buffers: a new pool's sweep
    keeps them (and still removes a dead owner's unmapped ones)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    mapped = create_buffer(f"tokenlake-{dead.pid}-abcdef01-slab-0", 4096).name
    lonely = create_buffer(f"tokenlake-{dead.pid}-abcdef02-slab-0", 4096).name
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import mmap, os, sys
        fd = os.open("/dev/shm/{mapped}", os.O_RDWR)
        m = mmap.mmap(fd, 4096)
        print("mapped", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        with LocalCluster(1, TINY, POOL_BYTES, segment_tokens=C, max_rows=64):
            names = list_buffers()
            assert mapped in names, "a buffer a live process maps was swept"
            assert lonely not in names, "a dead owner's unmapped buffer stayed"
    finally:
        holder.stdin.close()
        holder.wait(30)
        holder.stdout.close()
        for n in (mapped, lonely):
            unlink_buffer(n)


def test_a_restarted_instance_is_recorded_in_the_state_file(served_pool):
    before = {(r, i): pid for r, i, pid, _ in pool_state.read(served_pool.state_file)["engines"]}
    served_pool.kill("query", 0)
    served_pool.replace_failed()
    after = {(r, i): pid for r, i, pid, _ in pool_state.read(served_pool.state_file)["engines"]}
    assert after[("query", 0)] != before[("query", 0)]
    assert after[("query", 0)] == served_pool._procs[("query", 0)].pid


def test_records_follow_a_cached_document_through_the_real_engines(served_pool):
    doc = _doc(7, 3 * C + 2)
    tokens = {"a": doc}
    check_iteration(served_pool, tokens, {"a": len(doc)}, {"a": 0})
    served_pool.control.finish_request("a")
    records, torn = served_pool.records.read(0)
    keys = served_pool.control.pool.hasher.keys(doc)
    assert not torn and {r.key for r in records} >= set(keys)
    tree = served_pool.control.get_prefix_tree()
    assert all(r.tokens == tree.tokens(r.key) and r.parent == tree.parent(r.key) for r in records)

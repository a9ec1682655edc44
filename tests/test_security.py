"""CURVE on every socket of a cluster (issue #17, finding 8).

Before: anyone who reached an engine's port could read any slot, overwrite cached K/V
with a peer-style PUT, redirect a query engine's peers, or stop it. Now a cluster makes
its own keys; a socket without them (or with another cluster's) never completes the
handshake, so nothing it sends is read; a member of the cluster may use the data plane
but not send SHUTDOWN or PEERS; the control port and its credentials file follow the same
keys. ZeroMQ's socket monitor reports each handshake's outcome: the tests wait for that
event, not for a timeout.
"""

from __future__ import annotations

import dataclasses
import json
import random
import stat

import pytest
import torch
import zmq
from dataplane_util import TINY
from test_dataplane import POOL_BYTES, C, run_iteration
from zmq.utils.monitor import recv_monitor_message

import tokenlake
from tokenlake.core.errors import ConfigError, EngineUnavailable, NotAuthorized
from tokenlake.dataplane import credentials, wire
from tokenlake.dataplane.auth import ClusterKeys, connect_secure
from tokenlake.dataplane.messages import Ack, PeerPut, Peers, Ping, Pong, Shutdown, expect, parse
from tokenlake.dataplane.messages.transfer import SlotWrite
from tokenlake.deploy.local import LocalCluster
from tokenlake.engines.loop import EngineSpec
from tokenlake.service.serve import pool_service

HANDSHAKE = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "ok", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused",
             zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed",
             zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed"}


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, TINY, POOL_BYTES, segment_tokens=C, max_rows=256) as c:
        yield c


def handshake(endpoint: str, keys: ClusterKeys | None, *, as_owner: bool = False,
              send: list | None = None) -> str:
    """Connects a DEALER with ``keys`` (none: plain ZeroMQ), sends ``send`` if given, and
    returns how the first handshake ended (``ok``, ``refused``: the server's
    authenticator said no, ``failed``: no common key or mechanism)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    connect_secure(sock, keys, as_owner=as_owner)
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(endpoint)
        if send is not None:  # queued: delivered only after a handshake succeeds
            try:  # never blocks: a handshake that already failed leaves no pipe to queue on
                sock.send_multipart(send, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
        while monitor.poll(10_000):
            event = recv_monitor_message(monitor)["event"]
            if event in HANDSHAKE:
                return HANDSHAKE[event]
        raise AssertionError("no handshake event within 10 s")
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()


def other_client_pair(keys: ClusterKeys) -> ClusterKeys:
    """The cluster's server key, but a client key pair the cluster never made."""
    public, secret = zmq.curve_keypair()
    return dataclasses.replace(keys.member_view(), member_public=public.decode(),
                               member_secret=secret.decode())


# ---------------------------------------------------------------- keys


def test_each_party_holds_only_its_halves():
    keys = ClusterKeys.generate()
    assert len({keys.server_public, keys.member_public, keys.owner_public}) == 3
    engine, member = keys.engine_view(), keys.member_view()
    assert engine.owner_secret is None and engine.server_secret == keys.server_secret
    assert keys.engine_view(with_owner=True) == keys
    assert member.server_secret is None and member.owner_secret is None
    assert member.member_secret == keys.member_secret
    assert ClusterKeys.from_dict(member.to_dict()) == member
    assert ClusterKeys.generate() != keys  # fresh per cluster


@pytest.mark.parametrize("change,needle", [
    ({"server_public": "x" * 39}, "40 characters"),
    ({"member_secret": "#" * 40}, "Z85"),
    ({"extra": "y"}, "unknown CURVE key fields"),
])
def test_malformed_keys_are_refused(change, needle):
    d = {**ClusterKeys.generate().to_dict(), **change}
    with pytest.raises(ConfigError, match=needle):
        ClusterKeys.from_dict(d)
    if "extra" not in change:
        spec = dict(role="query", instance=0, cluster_id="x", buffers={"slab": {}}, keys=d)
        with pytest.raises(ConfigError, match=needle):
            EngineSpec(**spec)


# ---------------------------------------------------------------- engines


@pytest.mark.parametrize("role", ["query", "transfer"])
def test_only_the_clusters_keys_complete_a_handshake(cluster, role):
    endpoint = cluster._endpoints[(role, 1)]
    assert handshake(endpoint, None) == "failed"  # plain ZeroMQ: no CURVE, nothing read
    assert handshake(endpoint, ClusterKeys.generate()) == "failed"  # another cluster's keys
    assert handshake(endpoint, other_client_pair(cluster.keys)) == "refused"
    assert handshake(endpoint, cluster.keys) == "ok"  # a member
    assert handshake(endpoint, cluster.keys, as_owner=True) == "ok"


def test_a_forged_peer_put_from_outside_never_reaches_the_slab(cluster):
    """The attack of the issue: a peer-style PUT overwriting a cached segment. Sent by a
    process without the keys, it is never read: the slab keeps its bytes, and a query
    over the stored prefix still equals the reference."""
    rng = random.Random(3)
    doc = [rng.randrange(3, 900) for _ in range(3 * C)]
    tokens = {"sa": doc + [5, 6]}
    run_iteration(cluster, tokens, {"sa": len(doc) + 2})
    before = [cluster.slab(i).clone() for i in (0, 1)]
    kv = tuple(torch.full((C, 2, TINY.num_kv_heads, TINY.head_dim), 1e4)
               for _ in range(TINY.num_layers))
    for inst in (0, 1):
        for slot in range(3):
            forged = PeerPut(0, TINY.num_layers, (SlotWrite(slot, 0, C),), kv).encode(1)
            assert handshake(cluster._endpoints[("transfer", inst)], None, send=forged) == "failed"
    assert all(torch.equal(cluster.slab(i), b) for i, b in zip((0, 1), before))
    tokens["sb"] = doc + [7, 8, 9]
    run_iteration(cluster, tokens, {"sb": 3}, first_prefix={"sb": 3 * C})
    for rid in ("sa", "sb"):
        cluster.control.finish_request(rid)


@pytest.mark.parametrize("message", [Shutdown(), Peers(((1, None),))], ids=["SHUTDOWN", "PEERS"])
def test_a_member_may_not_stop_an_engine_or_change_its_peers(cluster, message):
    sock = cluster._dealer(("query", 0), as_owner=False)
    try:
        sock.send_multipart(message.encode(4))
        reply = wire.recv(sock, 5.0)
    finally:
        sock.close(0)
    with pytest.raises(NotAuthorized, match=f"only the cluster's owner may send {message.KIND.name}"):
        expect(reply, Ack)
    assert cluster.alive("query", 0)
    run_iteration_over_both(cluster, "nm")  # the peers are the same: answers still exact


def test_the_owner_may_change_peers(cluster):
    same = cluster._endpoints[("query", 1)]
    assert isinstance(cluster._request(("query", 0), Peers(((1, same),)), Ack), Ack)
    assert isinstance(cluster._request(("query", 0), Ping(), Pong), Pong)
    run_iteration_over_both(cluster, "ow")


def run_iteration_over_both(cluster, tag: str) -> None:
    rng = random.Random(tag)
    doc = [rng.randrange(3, 900) for _ in range(4 * C)]
    tokens = {f"{tag}a": doc + [1, 2]}
    run_iteration(cluster, tokens, {f"{tag}a": len(doc) + 2})
    tokens[f"{tag}b"] = doc + [3, 4, 5]
    run_iteration(cluster, tokens, {f"{tag}b": 3}, first_prefix={f"{tag}b": 4 * C})
    for rid in tokens:
        cluster.control.finish_request(rid)


def test_an_insecure_cluster_answers_plain_sockets():
    with LocalCluster(1, TINY, POOL_BYTES, segment_tokens=C, max_rows=64, insecure=True) as c:
        assert c.keys is None and c.client_info(0)["keys"] is None
        endpoint = c._endpoints[("query", 0)]
        assert handshake(endpoint, None) == "ok"
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart(Ping().encode(2))
            assert isinstance(parse(wire.recv(sock, 5.0)), Pong)
        finally:
            sock.close(0)
            ctx.term()


# ---------------------------------------------------------------- the control port


def test_the_control_port_and_its_credentials_file(cluster):
    with pool_service(cluster, control_port=0, http_port=0) as served:
        address, path = served.control.address, served.credentials
        assert path == str(credentials.default_path(address))
        mode = stat.S_IMODE(credentials.default_path(address).stat().st_mode)
        assert mode == 0o600, oct(mode)
        saved = json.loads(open(path).read())
        assert saved["address"] == address
        assert saved["keys"] == cluster.keys.member_view().to_dict()  # no server or owner secret
        assert handshake(address, None) == "failed"
        assert handshake(address, other_client_pair(cluster.keys)) == "refused"
        with tokenlake.connect(address) as cp:  # finds the file by the port
            assert cp.instances == (0, 1)
            client = cp.client(1)  # the data plane with the member keys it was given
            assert client.keys == cluster.keys.member_view()
        with tokenlake.connect(address, timeout_s=0.3, credentials={"keys": None}) as cp:
            with pytest.raises(EngineUnavailable, match="pass credentials="):
                cp.stats()
    assert not credentials.default_path(address).exists()  # removed when the service stops


def test_a_credentials_file_that_cannot_be_read_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the credentials file"):
        tokenlake.connect("tcp://127.0.0.1:1", credentials=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"address": "x"}))
    with pytest.raises(ConfigError, match="'keys'"):
        tokenlake.connect("tcp://127.0.0.1:1", credentials=bad)

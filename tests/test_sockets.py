"""Tests of the transport (tokenlake/dataplane/sockets.py) with the wire format over real
zmq sockets: timeouts become EngineUnavailable, ERROR replies become typed exceptions, a
ROUTER server survives malformed input, and sockets bind to loopback by default.
"""

from __future__ import annotations

import logging
import time

import msgpack
import pytest
import torch
import zmq

from tokenlake.core.errors import CapacityError, EngineUnavailable
from tokenlake.dataplane import wire
from tokenlake.dataplane.sockets import bind_address, send, send_routed
from tokenlake.dataplane.tensor_frames import CopyStats, WireError
from tokenlake.dataplane.wire import Kind, encode, error_message, raise_if_error, recv, recv_routed


@pytest.fixture(autouse=True)
def _fresh_copy_stats():
    CopyStats.reset()
    yield
    CopyStats.reset()


class Sockets:
    """Makes zmq sockets and keeps them referenced until teardown closes them all."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.made: list[zmq.Socket] = []

    def socket(self, socket_type: int) -> zmq.Socket:
        sock = self.context.socket(socket_type)
        self.made.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.made:
            sock.close(linger=0)
        self.context.term()


@pytest.fixture
def ctx():
    sockets = Sockets()
    yield sockets
    sockets.close()

def header(**overrides) -> bytes:
    """A packed header, valid unless overridden."""
    h = {"v": wire.PROTOCOL_VERSION, "k": int(Kind.PING), "id": 1, "b": {}, "t": []} | overrides
    return msgpack.packb(h, use_bin_type=True)


# ---------------------------------------------------------------- real sockets


def pair(ctx, endpoint: str = "inproc://wire-test"):
    a = ctx.socket(zmq.PAIR)
    a.bind(endpoint)
    b = ctx.socket(zmq.PAIR)
    b.connect(a.getsockopt_string(zmq.LAST_ENDPOINT))
    return a, b


@pytest.mark.parametrize("endpoint", ["inproc://wire-pair", bind_address()])
def test_send_recv_over_a_real_pair(ctx, endpoint):
    a, b = pair(ctx, endpoint)
    q = torch.randn(5, 4, 8)
    kv = torch.randn(5, 2, 2, 8).to(torch.bfloat16)
    send(a, encode(Kind.QUERY, 11, {"plan_id": 3, "layer": 0, "rows": 5}, [q, kv]), timeout_s=1)
    msg = recv(b, timeout_s=5)
    assert (msg.kind, msg.msg_id, msg.body) == (
        Kind.QUERY,
        11,
        {"plan_id": 3, "layer": 0, "rows": 5},
    )
    assert torch.equal(msg.tensors[0], q) and torch.equal(msg.tensors[1], kv)
    send(b, error_message(11, CapacityError("no slot")))
    with pytest.raises(CapacityError, match="no slot"):
        raise_if_error(recv(a, timeout_s=5))


def test_inproc_large_tensor_is_zero_copy_end_to_end(ctx):
    a, b = pair(ctx, "inproc://wire-zero-copy")
    t = torch.randn(256, 1024)  # 1 MiB, above pyzmq's copy threshold
    send(a, encode(Kind.SEGMENT_DATA, 1, {}, [t]))
    (got,) = recv(b, timeout_s=5).tensors
    assert torch.equal(got, t)
    assert CopyStats.bytes_copied == 0


def test_recv_timeout_raises_engine_unavailable_in_about_the_timeout(ctx):
    a, _ = pair(ctx, "inproc://wire-silent")
    start = time.monotonic()
    with pytest.raises(EngineUnavailable) as info:
        recv(a, timeout_s=0.3, peer="query engine 2")
    assert time.monotonic() - start < 0.3 + 1.0
    assert "query engine 2" in str(info.value) and "0.3 s" in str(info.value)
    with pytest.raises(EngineUnavailable, match="inproc://wire-silent"):
        recv(a, timeout_s=0)  # default peer name: the socket's endpoint


def test_timeouts_must_be_finite(ctx):
    a, _ = pair(ctx, "inproc://wire-finite")
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            recv(a, timeout_s=bad)


def test_send_with_timeout_to_nobody_raises_engine_unavailable(ctx):
    dealer = ctx.socket(zmq.DEALER)  # no peer connected: nowhere to queue
    start = time.monotonic()
    with pytest.raises(EngineUnavailable, match="0.2 s"):
        send(dealer, encode(Kind.PING, 1), timeout_s=0.2)
    assert time.monotonic() - start < 1.2


def test_a_closed_socket_raises_engine_unavailable(ctx):
    a, b = pair(ctx, "inproc://wire-closed")
    b.close(linger=0)
    with pytest.raises(EngineUnavailable):
        recv(b, timeout_s=0.1)


@pytest.mark.parametrize("client_type", [zmq.DEALER, zmq.REQ])
def test_router_server_answers_each_client_and_survives_malformed_input(ctx, client_type):
    server = ctx.socket(zmq.ROUTER)
    server.bind(bind_address())
    endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)
    client = ctx.socket(client_type)
    client.connect(endpoint)

    send(client, encode(Kind.PING, 1, {"from": "ce0"}))
    envelope, msg = recv_routed(server, timeout_s=5)
    assert (msg.kind, msg.body) == (Kind.PING, {"from": "ce0"})
    send_routed(server, envelope, encode(Kind.PONG, msg.msg_id))
    assert raise_if_error(recv(client, timeout_s=5)).kind is Kind.PONG

    # a malformed request gets an ERROR reply carrying its id; the server keeps serving
    send(client, [header(id=77, k=99)])
    with pytest.raises(WireError) as info:
        recv_routed(server, timeout_s=5)
    err = info.value
    assert err.envelope is not None and err.msg_id == 77
    send_routed(server, err.envelope, error_message(err.msg_id, err))
    reply = recv(client, timeout_s=5)
    assert reply.msg_id == 77
    with pytest.raises(WireError, match="unknown message kind 99"):
        raise_if_error(reply)

    send(client, encode(Kind.PING, 2))
    envelope, msg = recv_routed(server, timeout_s=5)
    send_routed(server, envelope, encode(Kind.PONG, msg.msg_id))
    assert recv(client, timeout_s=5).msg_id == 2


def test_recv_routed_times_out_too(ctx):
    server = ctx.socket(zmq.ROUTER)
    server.bind("inproc://wire-router-idle")
    with pytest.raises(EngineUnavailable):
        recv_routed(server, timeout_s=0.05)


# ---------------------------------------------------------------- addresses


def test_bind_address_defaults_to_loopback():
    assert bind_address() == "tcp://127.0.0.1:*"
    assert bind_address(port=5555) == "tcp://127.0.0.1:5555"
    assert bind_address("::1", 7000) == "tcp://[::1]:7000"
    for bad in ({"port": 0}, {"port": 70000}, {"port": True}, {"host": ""}, {"host": "a b"}):
        with pytest.raises(ValueError):
            bind_address(**bad)


def test_bind_address_warns_off_loopback(caplog):
    with caplog.at_level(logging.WARNING, logger="tokenlake.dataplane.sockets"):
        bind_address("localhost")
        assert not caplog.records
        assert bind_address("0.0.0.0", 6000) == "tcp://0.0.0.0:6000"
    assert "without CURVE" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenlake.dataplane.sockets"):
        bind_address("0.0.0.0", 6000, secure=True)  # CURVE on: nothing to warn about
    assert not caplog.records

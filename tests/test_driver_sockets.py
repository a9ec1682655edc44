"""The driver's sockets (``tokenlake.deploy.driver.DriverSockets``) against stand-in
engines on inproc sockets, with ``dead`` set by the test: an engine that has ended is
not waited for, before the send or while its answer is awaited (plain and streamed
exchanges alike); an answer it sent before it ended is still read; without ``dead``, or
while it says alive, a silent engine is waited for until the timeout; and ``ended_in``
reads processes (a missing one, or one that cannot be asked, counts as running)."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from tokenlake.core.errors import EngineUnavailable
from tokenlake.dataplane import wire
from tokenlake.dataplane.messages import Ack, Ping
from tokenlake.dataplane.messages.tier import TierProgress
from tokenlake.deploy.driver import DriverSockets, ended_in

KEY = ("transfer", 0)


@pytest.fixture
def engine():
    """An inproc ROUTER standing in for an engine, and a dealer factory for the driver."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://engine")

    def dealer(_key):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect("inproc://engine")
        return sock
    yield router, dealer
    router.close(0)
    ctx.term()


def _request(router):
    """The next request the stand-in got: (routing id, msg id)."""
    assert router.poll(5000)
    frames = router.recv_multipart()
    return frames[0], wire.decode(frames[1:]).msg_id


def _answer(router, who, msg_id, message=None):
    router.send_multipart([who, *(message or Ack()).encode(msg_id)])


@pytest.mark.parametrize("streamed", [False, True])
def test_an_engine_that_ends_while_awaited_is_given_up_at_once(engine, streamed):
    router, dealer = engine
    dead = threading.Event()
    drv = DriverSockets(dealer, 30.0, dead=lambda key: dead.is_set(), poll_s=0.02)
    got = {}
    progress = (lambda key, m: got.setdefault("progress", m)) if streamed else None
    t = threading.Thread(target=lambda: got.update(drv.exchange([KEY], Ping(), Ack, progress)))
    t0 = time.monotonic()
    t.start()
    who, msg_id = _request(router)
    if streamed:
        _answer(router, who, msg_id, TierProgress(3))
    dead.set()  # the engine ends without answering
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 10
    assert isinstance(got[KEY], EngineUnavailable) and "not running" in str(got[KEY])
    assert not streamed or got["progress"] == TierProgress(3)
    drv.close()


@pytest.mark.parametrize("streamed", [False, True])
def test_an_answer_sent_before_the_end_is_read(engine, streamed):
    router, dealer = engine
    dead = threading.Event()
    drv = DriverSockets(dealer, 30.0, dead=lambda key: dead.is_set(), poll_s=0.02)
    progress = (lambda key, m: None) if streamed else None
    got = {}
    t = threading.Thread(target=lambda: got.update(drv.exchange([KEY], Ping(), Ack, progress)))
    t.start()
    who, msg_id = _request(router)
    if streamed:
        _answer(router, who, msg_id, TierProgress(1))
    _answer(router, who, msg_id)  # answered, then ended: both are queued before the driver looks
    dead.set()
    t.join(10)
    assert got[KEY] == Ack()
    drv.close()


def test_an_ended_engine_is_not_sent_to_and_a_live_one_is_waited_for(engine):
    router, dealer = engine
    drv = DriverSockets(dealer, 0.3, dead=lambda key: key == ("query", 0), poll_s=0.02)
    out = drv.exchange([("query", 0)], Ping(), Ack)
    assert isinstance(out[("query", 0)], EngineUnavailable) and "not running" in str(out[("query", 0)])
    assert not router.poll(100)  # nothing was sent
    t0 = time.monotonic()
    out = drv.exchange([KEY], Ping(), Ack)  # alive but silent: the whole timeout
    assert time.monotonic() - t0 >= 0.3
    assert isinstance(out[KEY], EngineUnavailable) and "within 0.3 s" in str(out[KEY])
    drv.close()


def test_ended_in_reads_the_processes():
    class Proc:
        def __init__(self, alive):
            self.alive = alive

        def is_alive(self):
            if self.alive is None:
                raise ValueError("process object is closed")
            return self.alive
    dead = ended_in({("query", 0): Proc(True), ("query", 1): Proc(False), ("transfer", 0): Proc(None)})
    assert not dead(("query", 0)) and dead(("query", 1))
    assert not dead(("transfer", 0)) and not dead(("transfer", 9))

"""A transfer engine serves its puts and pings while a disk tier read is in flight
(``tokenlake/engines/tier_serving.py``), and the tier requests of the read's epoch too,
but not a fence: that one is answered only once the read is over. A real engine process; the read is held by a named pipe put where the tier file
was: the engine's reader blocks opening it until the test writes the file's bytes in."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dataplane_util import TINY
from test_tier_fence import SLOT, SLOTS, _doc, _push_out

from tokenlake.dataplane import messages, wire
from tokenlake.dataplane.messages import (
    ErrorReply,
    Ping,
    Pong,
    TierDone,
    TierList,
    TierListing,
    TierOps,
    TierRead,
)
from tokenlake.deploy.local import LocalCluster
from tokenlake.engines.tier_files import SUFFIX
from tokenlake.engines.tier_serving import TierServing

C = 8


@pytest.fixture
def disk_pool(tmp_path):
    with LocalCluster(1, TINY, SLOTS * SLOT, segment_tokens=C, max_rows=64, timeout_s=5.0,
                      tier_bytes=64 * (SLOT + 4096), tier_path=str(tmp_path)) as cluster:
        yield cluster, tmp_path / "instance-0"


def _written(path: Path, timeout_s: float = 30.0) -> bytes:
    """The file's bytes once the tier's writer has renamed it into place."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} was not written"
        time.sleep(0.01)
    return path.read_bytes()


def _held(path: Path) -> bytes:
    """Puts a named pipe where the tier file was (once written); returns its bytes."""
    data = _written(path)
    path.unlink()
    os.mkfifo(path)  # the engine's read now waits in open() until a writer comes
    return data


def _replies(sock, expected) -> None:
    """The next replies are ``(msg_id, kind)`` of ``expected``, in that order."""
    for msg_id, kind in expected:
        reply = wire.recv(sock, 10.0)
        assert reply.msg_id == msg_id and isinstance(messages.parse(reply), kind), (msg_id, reply.msg_id)


def test_a_disk_read_in_flight_holds_up_no_other_request(disk_pool):
    """While the reader is blocked the loop answers pings, and tier requests of the
    read's epoch; a drop of the key being read, and a fence (a higher epoch), wait for
    the read, and so does what follows them (answers come in the engine's order)."""
    cluster, directory = disk_pool
    keys = _push_out(cluster, _doc(1, 3 * C + 2))
    data = {k: _held(directory / (k.hex() + SUFFIX)) for k in keys[:2]}
    pool = cluster.control.pool
    free = []
    for _ in range(2):
        pool.evict_one(0)
        free.append(pool.slots.allocate(0))  # taken here: nothing else is placed in them
    epoch = cluster.control.tier_data_plane._epoch_of(0)
    sock = cluster._dealer(("transfer", 0))
    try:
        sent = [TierRead(((keys[0], free[0], -1),), epoch), Ping(), TierOps(epoch=epoch), TierList(),
                TierOps((keys[0],), epoch=epoch), Ping(), TierRead(((keys[1], free[1], -1),), epoch)]
        for msg_id, message in enumerate(sent, 1):
            sock.send_multipart(message.encode(msg_id))
        _replies(sock, [(2, Pong), (3, TierDone), (4, TierListing), (6, Pong)])
        with open(directory / (keys[0].hex() + SUFFIX), "wb") as fifo:  # the read goes on
            fifo.write(data[keys[0]])
        _replies(sock, [(1, TierDone), (5, TierDone)])  # the drop after the read, then the next read
        sock.send_multipart(TierOps(epoch=epoch + 1).encode(8))  # a fence
        sock.send_multipart(Ping().encode(9))
        _replies(sock, [(9, Pong)])
        with open(directory / (keys[1].hex() + SUFFIX), "wb") as fifo:
            fifo.write(data[keys[1]])
        read = wire.recv(sock, 10.0)
        assert read.msg_id == 7 and messages.parse(read).done == (keys[1],)
        _replies(sock, [(8, TierDone)])
    finally:
        sock.close(0)
    slab = cluster.slab(0)
    for k, slot in zip(keys, free):
        segment = data[k][-slab[slot].numel() * slab.element_size():]
        assert slab[slot].contiguous().view(-1).numpy().view("u1").tobytes() == segment


class _Engine(TierServing):
    """The tier part of a transfer engine alone, in this process: replies collected."""

    def __init__(self, path: Path) -> None:
        self.spec = SimpleNamespace(instance=0, tier_path=str(path), tier_bytes=1 << 20,
                                    tier_fsync=False, tier_write_bw=0)
        self.slab = torch.zeros(4, 2, 2, 1, C, 4)  # [slots, layers, 2, kv heads, C, head dim]
        self.num_slots, self.num_layers, self.shared = 4, 2, {}
        self.replies: list = []
        self.wakers: dict = {}
        self._init_tier()

    def reply(self, identity, frames) -> None:
        self.replies.append(wire.decode(frames))

    def refuse(self, identity, msg_id: int, exc: BaseException) -> None:
        self.reply(identity, wire.error_message(msg_id, exc))

    def add_waker(self, fd: int, serve) -> None:
        self.wakers[fd] = serve


def test_a_read_that_cannot_be_started_is_refused_and_blocks_nothing(tmp_path):
    """A read whose thread cannot take it (here: shut down) is answered with an error,
    and the tier requests after it are still served, a fence too (it would wait for a
    read in flight)."""
    engine = _Engine(tmp_path)
    try:
        engine._reader._threads.shutdown()
        engine.tier_request(b"", 1, TierRead(((bytes(16), 0, -1),), 0))
        engine.tier_request(b"", 2, TierOps(epoch=1))
        engine.tier_request(b"", 3, TierList())
        assert [m.msg_id for m in engine.replies] == [1, 2, 3]
        kinds = [type(messages.parse(m)) for m in engine.replies]
        assert kinds == [ErrorReply, TierDone, TierListing]
    finally:
        engine.close_tier()

"""A transfer engine serves its puts and pings while a disk tier read is in flight
(``tokenlake/engines/tier_serving.py``), and the tier requests of the read's epoch too,
but not a fence: that one is answered only once the read is over. A real engine process; the read is held by a named pipe put where the tier file
was: the engine's reader blocks opening it until the test writes the file's bytes in."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from dataplane_util import TINY
from test_tier_fence import SLOT, SLOTS, _doc, _push_out

from tokenlake.dataplane import messages, wire
from tokenlake.dataplane.messages import (
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


def test_a_disk_read_in_flight_holds_up_no_other_request(disk_pool):
    cluster, directory = disk_pool
    keys = _push_out(cluster, _doc(1, 3 * C + 2))
    path = directory / (keys[0].hex() + SUFFIX)
    data = _written(path)
    pool = cluster.control.pool
    pool.evict_one(0)
    free = pool.slots.allocate(0)  # taken here: nothing else is placed in it
    epoch = cluster.control.tier_data_plane._epoch_of(0)
    path.unlink()
    os.mkfifo(path)  # the engine's read now waits in open() until a writer comes
    sock = cluster._dealer(("transfer", 0))
    try:
        sent = [TierRead(((keys[0], free, -1),), epoch), Ping(), TierOps(epoch=epoch), TierList(),
                TierOps(epoch=epoch + 1), Ping()]  # the second TIER_OPS: a fence
        for msg_id, message in enumerate(sent, 1):
            sock.send_multipart(message.encode(msg_id))
        # While the reader is blocked the loop answers pings, and tier requests of the
        # read's epoch; the fence waits for the read (answers come in the engine's order).
        for msg_id, kind in ((2, Pong), (3, TierDone), (4, TierListing), (6, Pong)):
            reply = wire.recv(sock, 10.0)
            assert reply.msg_id == msg_id and isinstance(messages.parse(reply), kind)
        with open(path, "wb") as fifo:  # the read goes on: the file's bytes, whole
            fifo.write(data)
        done = wire.recv(sock, 10.0)
        assert done.msg_id == 1 and messages.parse(done).done == (keys[0],)
        fence = wire.recv(sock, 10.0)
        assert fence.msg_id == 5 and isinstance(messages.parse(fence), TierDone)
    finally:
        sock.close(0)
    slab = cluster.slab(0)
    segment = data[-slab[free].numel() * slab.element_size():]
    assert slab[free].contiguous().view(-1).numpy().view("u1").tobytes() == segment

"""The disk tier's bounded write bandwidth (``Pacer``, ``TierStore(write_bw=)``): a
steady stream of writes is held to the rate, an idle writer saves no more than a burst,
the writer waits between files while later copies stay staged (and copies beyond the
staging memory are refused), and closing writes what is staged without waiting."""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch
from dataplane_util import ManualClock

from tokenlake.engines.tier_store import Pacer, TierStore

LAYOUT = {"model": "test", "dtype": "uint8"}
N = 4096  # bytes of one segment here


def test_a_steady_stream_is_held_to_the_rate():
    clock = ManualClock(100.0)
    pacer = Pacer(1000.0, burst_s=0.0, clock=clock)
    waited = 0.0
    for _ in range(10):  # each write takes 0.1 s of the clock, the rate asks for 0.5 s
        began = clock.now
        clock.now += 0.1
        wait = pacer.delay(500, began)
        waited += wait
        clock.now += wait
    assert clock.now - 100.0 == pytest.approx(10 * 500 / 1000.0)
    assert waited == pytest.approx(10 * 0.4)


def test_an_idle_writer_saves_up_one_burst_only_and_zero_is_unbounded():
    clock = ManualClock(100.0)
    pacer = Pacer(1000.0, burst_s=0.25, clock=clock)
    clock.now += 60.0  # a minute without writes
    assert pacer.delay(250, clock.now) == 0.0  # the burst: 0.25 s of the rate
    assert pacer.delay(500, clock.now) == pytest.approx(0.5)  # then the rate again
    assert Pacer(0, clock=clock).delay(1 << 40, clock.now) == 0.0


class Gate(Pacer):
    """A pacer that asks for an hour after each write and says when it is first asked."""

    def __init__(self) -> None:
        super().__init__(1.0)
        self.asked = threading.Event()
        self.sizes: list[int] = []

    def delay(self, nbytes: int, began: float) -> float:
        self.sizes.append(nbytes)
        self.asked.set()
        return 3600.0


def _seg(i: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.shake_128(str(i).encode()).digest(N)), dtype=torch.uint8)


def test_the_writer_waits_between_files_and_closing_writes_the_rest_at_once(tmp_path):
    gate = Gate()
    store = TierStore(tmp_path, 1 << 20, LAYOUT, staging_bytes=3 * N, fsync=False, write_bw=gate)
    keys = [bytes([i]) * 16 for i in range(5)]
    try:
        assert all(store.stage(keys[i], _seg(i)) for i in range(3))
        assert gate.asked.wait(60), "the writer wrote the first file and asked the pacer"
        # paced after the first file: the other two wait staged, read back from memory
        assert store.written == 1 and store.staged_bytes == 2 * N
        assert store.stage(keys[3], _seg(3))  # 3 segments staged: the staging memory is full
        assert not store.stage(keys[4], _seg(4)) and store.refused == 1
        out = torch.empty(N, dtype=torch.uint8)
        assert store.read_into(keys[2], out) and torch.equal(out, _seg(2))
    finally:
        closer = threading.Thread(target=store.close)
        closer.start()
        closer.join(60)
    assert not closer.is_alive(), "closing waited for the pacer"
    assert store.written == 4 and gate.sizes[0] == N
    counters = store.counters()  # what its engine reports with every TIER_DONE
    assert counters["written"] == 4 and counters["refused"] == 1 and counters["reads"] == 1
    assert counters["paced_s"] > 0 and counters["staged_bytes"] == 0  # it waited until closed
    reopened = TierStore(tmp_path, 1 << 20, LAYOUT, fsync=False, write_bw=0)
    try:
        assert sorted(k for k, _ in reopened.listing()) == keys[:4]
        for i in range(4):
            assert reopened.read_into(keys[i], out) and torch.equal(out, _seg(i))
    finally:
        reopened.close()

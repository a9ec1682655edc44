"""The tier driver's fences against transfer engines that stall (``TierDriver``): a
stateful test runs the real driver and control plane over simulated engines, which
stop answering at any step and carry out what they were sent later, at any later step
and in any order relative to the driver's fences. After every step every ready
replica's slot holds its own segment: no write-through staged from a slot that was
reused, no read carried out into a slot given to another segment."""

from __future__ import annotations

import random
from types import SimpleNamespace

from dataplane_util import TINY
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tokenlake.core.config import PoolConfig
from tokenlake.core.control import ControlPlane
from tokenlake.core.errors import CapacityError, EngineUnavailable
from tokenlake.dataplane.messages import TierDone, TierRead
from tokenlake.deploy import tier as tier_driver

C = 2
DOCS = ([1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 4, 4], [5, 5, 6, 6], [7, 7], [8, 8, 9, 9, 10, 10])


class Engine:
    """One transfer engine's tier: what it does with a message, when it does it."""

    def __init__(self, inst: int, slab: dict) -> None:
        self.inst, self.slab = inst, slab  # slab: (instance, slot) -> the segment it holds
        self.epoch = 0
        self.files: dict[bytes, bytes | None] = {}
        self.stalled = False
        self.queue: list = []  # received, not carried out yet
        self.overtake = False  # a new request is carried out before the queued ones

    def carry_out(self, msg) -> TierDone:
        keys = [it[0] for it in msg.items] if isinstance(msg, TierRead) else [e.key for _, e in msg.writes]
        if msg.epoch < self.epoch:
            return TierDone((), tuple(keys))
        self.epoch = msg.epoch
        done, failed = [], []
        if isinstance(msg, TierRead):
            for key, slot, target in msg.items:
                if self.files.get(key) is None:
                    failed.append(key)
                    continue
                self.slab[(self.inst if target < 0 else target, slot)] = self.files[key]
                done.append(key)
        else:
            for key in msg.drops:
                self.files.pop(key, None)
            for slot, e in msg.writes:
                self.files[e.key] = self.slab.get((self.inst, slot))  # its bytes now
                done.append(e.key)
        return TierDone(tuple(done), tuple(failed))


class FakeCluster:
    """What ``TierDriver`` asks of a launcher, over :class:`Engine` s."""

    def __init__(self, control, slab) -> None:
        self.control = control
        self.config = SimpleNamespace(segment_bytes=1 << 30)  # one segment per TIER_READ
        self.engines = {i: Engine(i, slab) for i in control.instances}

    def _request(self, key, message, reply):
        engine = self.engines[key[1]]
        # what came before is not carried out yet, unless this one overtakes it
        if engine.stalled or (engine.queue and not engine.overtake):
            engine.queue.append(message)
            raise EngineUnavailable(f"instance {key[1]} did not answer")
        return engine.carry_out(message)

    def _tier_request(self, key, message, reply, channel="reads"):
        return self._request(key, message, reply)

    def alive(self, role, instance) -> bool:
        return True


class FenceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._retry, tier_driver.FENCE_RETRY_S = tier_driver.FENCE_RETRY_S, 0.0
        self.cp = ControlPlane(PoolConfig(C, "t", 2, vnodes=8, page_tokens=C, tier_slots=4), TINY,
                               [0, 1], clock=lambda: 0.0, rng=random.Random(0))
        self.slab: dict[tuple[int, int], bytes] = {}
        self.cluster = FakeCluster(self.cp, self.slab)
        self.cp.tier_data_plane = tier_driver.TierDriver(self.cluster, background=False)

    def teardown(self) -> None:
        tier_driver.FENCE_RETRY_S = self._retry

    @rule(doc=st.sampled_from(DOCS))
    def store(self, doc):
        pool, parent = self.cp.pool, None
        for i, key in enumerate(pool.hasher.keys(doc)):
            try:
                placed = pool.place(key, parent, i, doc[i * C:(i + 1) * C])
            except CapacityError:
                break
            if placed.created:
                self.slab[(placed.location.instance, placed.location.slot)] = key
                pool.commit(key, placed.location.instance)
            parent = key
        self.cp.flush_tier()

    @rule(doc=st.sampled_from(DOCS))
    def promote(self, doc):
        self.cp.promote([(doc + [99], None)])

    @rule(inst=st.sampled_from([0, 1]))
    def evict(self, inst):
        self.cp.pool.evict_one(inst)
        self.cp.flush_tier()

    @rule(inst=st.sampled_from([0, 1]))
    def stall(self, inst):
        self.cluster.engines[inst].stalled = True

    @rule(inst=st.sampled_from([0, 1]), overtake=st.booleans())
    def resume(self, inst, overtake):
        self.cluster.engines[inst].stalled = False
        self.cluster.engines[inst].overtake = overtake

    @rule(inst=st.sampled_from([0, 1]), pick=st.integers(0, 3))
    def carry_out_one_late(self, inst, pick):
        # any of them: requests come on several sockets, which an engine reads in turn
        engine = self.cluster.engines[inst]
        if engine.queue and not engine.stalled:
            engine.carry_out(engine.queue.pop(pick % len(engine.queue)))

    @rule()
    def flush(self):
        self.cp.flush_tier()

    @rule()
    def fence(self):
        self.cp.tier_data_plane.fence_due()  # the driver's fencing thread, at any step

    @rule(doc=st.sampled_from(DOCS), other=st.sampled_from(DOCS), inst=st.sampled_from([0, 1]),
          evict=st.booleans(), overtake=st.booleans())
    def a_stall_around_a_promotion(self, doc, other, inst, evict, overtake):
        # the steps that make a stale write possible, in one rule (any of them may do nothing)
        self.stall(inst)
        self.promote(doc)
        if evict:
            self.evict(inst)
        self.store(other)
        self.resume(inst, overtake)

    @rule(order=st.permutations(range(4)))
    def everyone_answers_again(self, order):
        # every engine answers, what they held back is carried out (in some order) or
        # refused: once a flush has fenced them, nothing stays held or leased for it
        for engine in self.cluster.engines.values():
            engine.stalled = False
            late = [engine.queue[i] for i in order if i < len(engine.queue)] + engine.queue[len(order):]
            engine.queue = []
            for msg in late:
                engine.carry_out(msg)
        self.cp.tier_data_plane.fence_due()
        self.cp.flush_tier()
        assert self.cp.pool.tier.held_back() == [], "slots held back after every engine answered a fence"
        assert not self.cp.pool.tier._staging, "a write-through still leased after every engine answered"
        self.cp.flush_tier()  # what the last one queued (drops a refused request carried)
        keys = set(self.cp.pool.tree.keys())
        for inst, engine in self.cluster.engines.items():
            for key in engine.files:  # no copy the control plane has given up stays behind
                assert key in keys and self.cp.pool.tree.node(key).tier == inst, "a tier file outlived its copy"

    @invariant()
    def every_ready_slot_holds_its_segment(self):
        self.cp.check()
        tree = self.cp.pool.tree
        for key in tree.keys():
            for loc in tree.replicas(key):
                assert self.slab.get((loc.instance, loc.slot)) == key, "a ready slot holds another segment"


FenceMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_fence_machine = FenceMachine.TestCase


def test_after_one_read_goes_unanswered_no_other_is_sent_to_that_engine_before_its_fence():
    """A promotion of several segments on one instance goes out one ``TIER_READ`` at a
    time; once one is not answered, the rest are not sent at the old epoch (each would
    wait out the timeout, and be carried out later by a stalled engine): they fail at
    once, and only the fence goes to that engine."""
    from tokenlake.core.tier import Promotion

    cp = ControlPlane(PoolConfig(C, "t", 2, vnodes=8, page_tokens=C, tier_slots=4), TINY, [0, 1],
                      clock=lambda: 0.0, rng=random.Random(0))
    cluster = FakeCluster(cp, {})
    sent: list = []
    request = cluster._request

    def counted(key, message, reply):
        sent.append(message)
        return request(key, message, reply)

    cluster._request = counted
    cluster.engines[0].stalled = True
    driver = tier_driver.TierDriver(cluster, background=False)
    promotions = [Promotion(bytes([k]) * 16, 0, k) for k in range(3)]
    failed, unanswered = driver.tier_read(promotions)
    reads = [m for m in sent if isinstance(m, TierRead)]
    assert len(reads) == 1, "one read to the silent engine, no more"
    assert failed == {p.key for p in promotions} and set(unanswered) == {promotions[0].key}
    driver.close()

"""The serving loop's background tier reads (``tokenlake/generation/tier_reads.py``),
with a stand-in control plane whose reads wait on the test: a request is left out while
its read runs, its promotion ends in a later step, an idle loop waits for it, and the
loop waits for every read before it replaces an instance."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from tokenlake.generation.recovery import Recovery
from tokenlake.generation.tier_reads import TierReads


class Control:
    """What TierReads asks of a control plane; each read waits for ``gate``."""

    def __init__(self) -> None:
        self.pool = SimpleNamespace(tier=object())
        self.gate = threading.Event()
        self.ended: list = []
        self.tier_data_plane = self

    def begin_promotion(self, prompts):
        prompts = list(prompts)
        held = [i for i, (tokens, _salt) in enumerate(prompts) if tokens[0] == 7]  # "in the tier"
        return SimpleNamespace(promos=[f"p{i}" for i in held], prompts=held) if held else None

    def tier_read(self, promos):
        assert self.gate.wait(30), "the test never let the read through"
        return set(), {}

    def end_promotion(self, batch, outcome):
        self.ended.append((batch, outcome))
        return len(batch.promos)


def live(rid, first, lost_hit=False):
    return SimpleNamespace(request_id=rid, prompt=(first, 1, 2), req=SimpleNamespace(cache_salt=None),
                           lost_hit=lost_hit)


def test_a_request_waits_out_of_sight_while_its_read_runs_and_the_rest_go_on():
    control = Control()
    reads = TierReads(control)
    a, b = live("a", 7), live("b", 1)
    assert reads.step([a, b], idle=False) == {"a"}  # b goes on now
    assert reads.step([a], idle=False) == {"a"} and not control.ended  # not done: still out
    control.gate.set()
    assert reads.step([a], idle=True) == set()  # idle: waits for the read, then ends it
    assert len(control.ended) == 1 and reads.promoted == 1
    assert reads.drain() is False  # nothing left in flight
    reads.close()


def test_a_request_whose_matched_prefix_went_reads_nothing_back():
    """A request the loop admits next without a hit (its matched prefix was evicted
    before its admission: ``lost_hit``) computes its prompt whole: no read is begun for
    it, and it is not kept out of the scheduler's sight."""
    control = Control()
    reads = TierReads(control)
    assert reads.step([live("a", 7, lost_hit=True)], idle=True) == set()
    assert reads.reading() == set() and control.ended == []
    reads.close()


def test_a_cancelled_requests_read_is_still_waited_for_and_ended():
    control = Control()
    reads = TierReads(control)
    reads.step([live("a", 7)], idle=False)
    assert reads.reading() == {"a"}  # the loop stays busy for it, though "a" is gone
    control.gate.set()
    assert reads.drain() is True and reads.reading() == set() and len(control.ended) == 1
    reads.close()


def test_the_loop_waits_for_its_reads_before_it_replaces_an_instance():
    order: list[str] = []

    class Loop(Recovery):
        def __init__(self) -> None:
            self._tier_reads = SimpleNamespace(drain=lambda: order.append("drain"))
            self.cluster = SimpleNamespace(replace_failed=lambda: order.append("replace") or ())

    assert Loop().recover() == ()
    assert order == ["drain", "replace"]

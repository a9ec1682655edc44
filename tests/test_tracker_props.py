"""Property test of the request tracker: random operations replayed on
:class:`tokenlake.generation.tracker.RequestTracker` and on a shadow model of plain tuples.

Every operation, legal or not in the request's phase, is applied to both; an illegal
one must raise :class:`TrackerError` and change nothing. After every step the tracker's
invariants hold (``check()``), its records, table orders, views and cache-load inputs
equal the shadow's, the latter derived here from the paper's §6.1 definition.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tokenlake.core.cost_model import LoadRequest
from tokenlake.generation.tracker import RequestTracker, TrackedRequest, TrackerError

CHUNK = 8
IDS = st.sampled_from([f"r{i}" for i in range(6)])


class TrackerMachine(RuleBasedStateMachine):
    """Shadow: rid -> [phase, prompt, hit, prefilled, generated]; ``order`` lists ids
    in add order, ``admitted`` in admission order."""

    def __init__(self) -> None:
        super().__init__()
        self.t = RequestTracker(CHUNK)
        self.shadow: dict[str, list] = {}
        self.order: list[str] = []
        self.admitted: list[str] = []

    def _apply(self, rid: str, legal: bool, op) -> None:
        before = dict((k, list(v)) for k, v in self.shadow.items())
        rec = self.t.get(rid) or TrackedRequest(rid, 1)
        if legal:
            op(rec)
            return
        try:
            op(rec)
        except TrackerError:
            assert self.shadow == before
            return
        raise AssertionError(f"an illegal operation on {rid} was accepted")

    @rule(rid=IDS, prompt=st.integers(1, 40))
    def add(self, rid, prompt):
        legal = rid not in self.shadow
        if legal:
            self.t.add(TrackedRequest(rid, prompt, arrival_s=float(len(self.order))))
            self.shadow[rid] = ["waiting", prompt, 0, 0, 0]
            self.order.append(rid)
        else:
            self._apply(rid, False, lambda rec: self.t.add(TrackedRequest(rid, prompt)))

    @rule(rid=IDS, hit=st.integers(-1, 41))
    def set_hit(self, rid, hit):
        s = self.shadow.get(rid)
        legal = s is not None and s[0] == "waiting" and 0 <= hit < s[1]
        self._apply(rid, legal, lambda rec: self.t.set_hit(rec, hit))
        if legal:
            s[2] = hit

    @rule(rid=IDS, hit=st.none() | st.integers(0, 41))
    def admit(self, rid, hit):
        s = self.shadow.get(rid)
        legal = s is not None and s[0] == "waiting" and (hit is None or hit < s[1])
        self._apply(rid, legal, lambda rec: self.t.admit(rec, hit))
        if legal:
            s[2] = s[2] if hit is None else hit
            s[0], s[3] = "prefill", s[2]
            self.admitted.append(rid)

    @rule(rid=IDS)
    def requeue(self, rid):
        s = self.shadow.get(rid)
        legal = s is not None and s[0] == "prefill" and s[3] == s[2]
        self._apply(rid, legal, self.t.requeue)
        if legal:
            s[0], s[3] = "waiting", 0
            self.admitted.remove(rid)

    @rule(rid=IDS, n=st.integers(-1, 40))
    def advance_prefill(self, rid, n):
        s = self.shadow.get(rid)
        legal = s is not None and s[0] == "prefill" and 0 <= n <= s[1] - s[3]
        self._apply(rid, legal, lambda rec: self.t.advance_prefill(rec, n))
        if legal:
            s[3] += n
            if s[3] == s[1]:
                s[0], s[4] = "decode", 1

    @rule(rid=IDS, n=st.integers(-1, 5))
    def advance_decode(self, rid, n):
        s = self.shadow.get(rid)
        legal = s is not None and s[0] == "decode" and n >= 0
        self._apply(rid, legal, lambda rec: self.t.advance_decode(rec, n))
        if legal:
            s[4] += n

    @rule(rid=IDS)
    def finish(self, rid):
        s = self.shadow.get(rid)
        legal = s is not None and s[0] == "decode"
        self._apply(rid, legal, self.t.finish)
        if legal:
            s[0] = "done"

    @rule(rid=IDS)
    def remove(self, rid):
        legal = rid in self.shadow
        self._apply(rid, legal, self.t.remove)
        if legal:
            del self.shadow[rid]
            self.order.remove(rid)
            if rid in self.admitted:
                self.admitted.remove(rid)

    @invariant()
    def matches_the_shadow(self):
        t = self.t
        t.check()
        assert list(t) == self.order
        assert [r.request_id for r in t.waiting()] == [x for x in self.order if self.shadow[x][0] == "waiting"]
        assert [r.request_id for r in t.running()] == self.admitted
        for rid, (phase, prompt, hit, prefilled, generated) in self.shadow.items():
            rec = t[rid]
            assert (rec.phase, rec.prompt_len, rec.hit, rec.prefilled, rec.generated) == \
                (phase, prompt, hit, prefilled, generated)
            if phase == "done":
                continue
            if phase == "decode":
                ctx, left, shown = prompt + generated - 1, 0, "decode"
                load = LoadRequest(1, ctx)
            else:
                ctx = hit if phase == "waiting" else prefilled
                left, shown = prompt - ctx, "prefill"
                load = LoadRequest(min(CHUNK, left), ctx)
            v = t.view(rec)
            assert (v.request_id, v.phase, v.context_tokens, v.remaining_prefill) == (rid, shown, ctx, left)
            assert t.load(rec) == load
        waiting, running = t.views()
        assert [v.request_id for v in waiting + running] == [
            x for x in self.order if self.shadow[x][0] == "waiting"] + [
            x for x in self.admitted if self.shadow[x][0] != "done"]


TrackerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTracker = TrackerMachine.TestCase

"""The request tracker (tokenlake/generation/tracker.py): phases, derivations, and its two
users -- the serving loop and the simulator -- seeing one request state the same way.

The phase rules, views and cache-load inputs are checked against the paper's §6.1
definition written out here (input = tokens computed this iteration, prefix = tokens
already cached); the server tests use a pure control plane and stand-ins for the
cluster and the compute engine, so no engine process starts.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from tokenlake.core.cost_model import LoadRequest, get_cache_load
from tokenlake.generation.tracker import (
    DECODE,
    DONE,
    PREFILL,
    WAITING,
    RequestTracker,
    TrackedRequest,
    TrackerError,
)

CHUNK = 512


def walk(tracker: RequestTracker, rid: str, prompt: int, hit: int = 0, prefilled: int | None = None,
         generated: int = 0) -> TrackedRequest:
    """Adds ``rid`` and brings it to a state: waiting (prefilled None, generated 0),
    prefilling (prefilled < prompt) or decoding (generated >= 1)."""
    rec = tracker.add(TrackedRequest(rid, prompt, arrival_s=1.5, tbt_slo_s=0.1))
    if prefilled is None and not generated:
        tracker.set_hit(rec, hit)
        return rec
    tracker.admit(rec, hit)
    tracker.advance_prefill(rec, (prompt if generated else prefilled) - hit)
    if generated:
        tracker.advance_decode(rec, generated - 1)
    return rec


# ------------------------------------------------------------------ phases


def test_a_request_goes_waiting_prefill_decode_done():
    t = RequestTracker(CHUNK)
    r = t.add(TrackedRequest("a", 1000))
    assert (r.phase, r.context, r.remaining) == (WAITING, 0, 1000)
    t.set_hit(r, 256)
    assert (r.context, r.remaining, r.prefilled) == (256, 744, 0)
    assert t.admit(r) == 256
    assert (r.phase, r.prefilled, r.context) == (PREFILL, 256, 256)
    assert t.advance_prefill(r, 500) is False
    assert t.advance_prefill(r, 244) is True  # the last chunk also made the first token
    assert (r.phase, r.generated, r.context, r.remaining) == (DECODE, 1, 1000, 0)
    t.advance_decode(r, 3)
    assert (r.generated, r.context) == (4, 1003)  # the 4th token is the next input
    t.finish(r)
    assert r.phase == DONE and "a" in t
    t.remove(r)
    assert "a" not in t and len(t) == 0
    t.check()


@pytest.mark.parametrize("bad", [
    lambda t, r: t.advance_prefill(r, 1),  # waiting: not admitted
    lambda t, r: t.advance_decode(r),
    lambda t, r: t.finish(r),
    lambda t, r: t.requeue(r),
    lambda t, r: t.set_hit(r, 1000),  # hit must leave one token to compute
    lambda t, r: t.set_hit(r, -1),
    lambda t, r: t.add(TrackedRequest("a", 5)),  # duplicate id
])
def test_operations_the_phase_does_not_allow_are_typed_errors(bad):
    t = RequestTracker(CHUNK)
    r = t.add(TrackedRequest("a", 1000))
    with pytest.raises(TrackerError):
        bad(t, r)
    t.check()
    assert (r.phase, r.hit, r.prefilled) == (WAITING, 0, 0)  # nothing changed


def test_admitted_requests_keep_their_hit_and_cannot_overshoot():
    t = RequestTracker(CHUNK)
    r = walk(t, "a", 1000, hit=256, prefilled=300)
    with pytest.raises(TrackerError):
        t.set_hit(r, 512)  # the prefix it reuses was fixed at admission
    with pytest.raises(TrackerError):
        t.advance_prefill(r, 701)  # 700 remain
    with pytest.raises(TrackerError):
        t.requeue(r)  # it computed 44 tokens: taking it back would lose them
    assert (r.hit, r.prefilled) == (256, 300)


def test_requeue_returns_to_add_order_and_running_keeps_admission_order():
    t = RequestTracker(CHUNK)
    a, b, c = (t.add(TrackedRequest(x, 100)) for x in "abc")
    t.admit(c)
    t.admit(a, 10)
    assert [r.request_id for r in t.running()] == ["c", "a"]
    t.requeue(a)
    assert (a.phase, a.prefilled, a.hit) == (WAITING, 0, 10)
    assert [r.request_id for r in t.waiting()] == ["a", "b"]
    assert list(t) == ["a", "b", "c"]
    t.check()


def test_preempt_sends_a_running_request_back_with_its_outputs_as_prompt():
    t = RequestTracker(CHUNK)
    a = walk(t, "a", 100, hit=32, generated=5)  # decoding: prompt 100, 5 tokens out
    b = walk(t, "b", 50, prefilled=20)  # prefilling
    c = walk(t, "c", 70)  # waiting
    t.preempt(a, 105)  # the owner's prompt plus the 5 outputs
    assert (a.phase, a.prompt_len, a.hit, a.prefilled, a.generated) == (WAITING, 105, 0, 0, 0)
    t.preempt(b, 50)
    assert [r.request_id for r in t.waiting()] == ["a", "b", "c"]  # their places kept
    assert t.view(a).remaining_prefill == 105 and t.load(a) == LoadRequest(105, 0)
    with pytest.raises(TrackerError, match="cannot be preempted"):
        t.preempt(c, 70)  # waiting: nothing to lose
    with pytest.raises(TrackerError, match="prompt_len"):
        t.preempt(walk(t, "d", 10, prefilled=3), 0)
    t.admit(a, 64)  # its earlier segments may still be cached
    t.advance_prefill(a, 41)
    assert (a.phase, a.generated, a.context) == (DECODE, 1, 105)
    t.check()


def test_check_finds_a_record_changed_behind_the_trackers_back():
    t = RequestTracker(CHUNK)
    r = walk(t, "a", 1000, prefilled=300)
    t.check()
    r.prefilled = 1000  # prompt complete but still PREFILL
    with pytest.raises(TrackerError):
        t.check()
    r.prefilled, r.phase = 300, WAITING  # waiting while in the running table
    with pytest.raises(TrackerError):
        t.check()


# -------------------------------------------------------------- derivations


def test_views_and_loads_follow_the_paper_definition():
    """Waiting: a prefill over its hit; prefilling: a chunk over what is computed;
    decoding: one new token over prompt + outputs fed back (paper §6.1)."""
    t = RequestTracker(CHUNK)
    w = walk(t, "w", 3000, hit=2048)
    p = walk(t, "p", 5000, hit=256, prefilled=1500)
    tail = walk(t, "tail", 1700, prefilled=1600)  # less than a chunk left
    d = walk(t, "d", 700, generated=5)
    assert [t.load(r) for r in (w, p, tail, d)] == [
        LoadRequest(512, 2048), LoadRequest(512, 1500), LoadRequest(100, 1600), LoadRequest(1, 704)]
    waiting, running = t.views()
    assert [(v.request_id, v.phase, v.context_tokens, v.remaining_prefill) for v in waiting] == [
        ("w", "prefill", 2048, 952)]
    assert [(v.request_id, v.phase, v.context_tokens, v.remaining_prefill) for v in running] == [
        ("p", "prefill", 1500, 3500), ("tail", "prefill", 1600, 100), ("d", "decode", 704, 0)]
    assert all(v.arrival_s == 1.5 and v.tbt_slo_s == 0.1 for v in waiting + running)


def test_cache_load_is_the_core_formula_over_the_tracker_inputs():
    from evals.sim.config import SimConfig

    s = SimConfig(instances=4).resolve()
    t = RequestTracker(CHUNK)
    recs = [walk(t, "w", 3000, hit=2048), walk(t, "d", 700, generated=5)]
    want = get_cache_load([LoadRequest(512, 2048), LoadRequest(1, 704)], 4, s.model, s.hardware, s.latency)
    assert want > 0
    assert t.cache_load(recs, 4, s.model, s.hardware, s.latency) == want
    assert t.cache_load([], 4, s.model, s.hardware, s.latency) == 0.0


def test_the_tracker_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from tokenlake.generation.tracker import RequestTracker\n"
            "import evals.sim.pooled, evals.sim.unpooled, evals.sim.xpyd\n"
            "import tokenlake.generation\n"
            "assert 'tokenlake.generation.loop' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------- server and simulator agree


class _Cluster:
    """What the server reads of a cluster, around a pure control plane (no processes)."""

    def __init__(self, control, n_instances: int) -> None:
        self.control, self.n_instances, self.max_rows = control, n_instances, 4096

    def replicate(self, reps) -> None:
        pass


class _Engine:
    """Stands in for the compute engine: every request's logits favour token 5."""

    parallel = False

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def run(self, plans, batches):
        import torch

        logits = torch.zeros(self.vocab)
        logits[5] = 1.0
        return SimpleNamespace(logits={r.request_id: logits for b in batches for r in b.requests})


def _server(setup, **kw):
    """A :class:`GenerationLoop` on the simulator's model, hardware and latency model."""
    pytest.importorskip("torch")
    from tokenlake.core.config import PoolConfig
    from tokenlake.core.control import ControlPlane
    from tokenlake.generation.loop import GenerationLoop

    pool = PoolConfig(setup.segment_tokens, "tracker-test", 4096)
    cp = ControlPlane(pool, setup.model, list(range(setup.instances)))
    weights = SimpleNamespace(config=SimpleNamespace(vocab_size=1000, max_context=1 << 20))
    return GenerationLoop(_Cluster(cp, setup.instances), weights, chunk_tokens=setup.chunk_tokens,
                  latency=setup.latency, hardware=setup.hardware.name, tbt_slo_s=0.1,
                  clock=lambda: 1.5, engine=_Engine(1000), rebalance_every=0, **kw)


def _cache(server, tokens) -> None:
    """Stores ``tokens`` in the server's pool (a finished request of its own)."""
    from tokenlake.core.plans import Batch, BatchRequest

    cp = server.cluster.control
    cp.complete(cp.gen_plans([Batch((BatchRequest("seed", tuple(tokens)),))], [1]))
    cp.finish_request("seed")


def test_server_and_simulator_derive_the_same_views_and_cache_load():
    """The same request states -- waiting with a hit, prefilling, decoding -- give the
    same snapshot views and the same cache load in the serving loop and in the
    simulator, and both equal the §6.1 inputs written out here."""
    from evals.sim.backend import SimRequest
    from evals.sim.config import SimConfig
    from evals.sim.systems import make_backend
    from evals.workloads.base import Request
    from tokenlake.generation.requests import GenerationRequest

    backend = make_backend("tokenlake", SimConfig(instances=4, segment_tokens=256, chunk_tokens=512))
    setup = backend.setup
    server = _server(setup)
    doc = [7 + i % 500 for i in range(2048)]
    _cache(server, doc)
    prompts = {"w": doc + [3] * 952, "p": [4] * 5000, "d": [6] * 700}
    for rid, prompt in prompts.items():
        server.submit(GenerationRequest(rid, tuple(prompt), max_new_tokens=50))
    st = server.tracker
    st.admit(st["p"], 0)
    st.advance_prefill(st["p"], 1500)
    st.admit(st["d"], 0)
    st.advance_prefill(st["d"], 700)
    st.advance_decode(st["d"], 4)
    served = server.snapshot()  # matches "w" in the pool: hit 2048

    sim = backend.tracker
    for i, (rid, prompt) in enumerate(prompts.items()):
        r = SimRequest(i, Request(rid, 1.5, len(prompt), 50, token_ids=tuple(prompt)))
        r.tbt_slo_s = 0.1
        sim.add(r)
    sim.set_hit(sim["w"], 2048)
    sim.admit(sim["p"], 0)
    sim.advance_prefill(sim["p"], 1500)
    sim.admit(sim["d"], 0)
    sim.advance_prefill(sim["d"], 700)
    sim.advance_decode(sim["d"], 4)
    backend.now = 1.5
    vis = [sim["w"], sim["p"], sim["d"]]
    simulated = backend.snapshot(vis, backend.cache_load(vis))

    assert served.waiting == simulated.waiting and served.running == simulated.running
    want = get_cache_load([LoadRequest(512, 2048), LoadRequest(512, 1500), LoadRequest(1, 704)],
                          setup.instances, setup.model, setup.hardware, setup.latency)
    assert 0 < want < 0.99  # the server caps the load at 0.99
    assert served.cache_load == simulated.cache_load == want


def test_a_prompt_is_matched_once_in_the_iteration_that_admits_it(monkeypatch):
    """The serving loop matches a waiting prompt once per iteration; the view, the cache
    load and the admission (the prefix it sends) reuse that match. The control plane's
    own check of the declared prefix is a match of the prefix, not of the prompt."""
    from evals.sim.config import SimConfig
    from tokenlake.core.prefix_tree import PrefixTree
    from tokenlake.generation.requests import GenerationRequest

    setup = SimConfig(instances=4, segment_tokens=256, chunk_tokens=512).resolve()
    server = _server(setup)
    doc = [7 + i % 500 for i in range(1024)]
    _cache(server, doc)
    prompt = tuple(doc + [3] * 100)
    matched = []
    real = PrefixTree.match

    def counting(tree, token_ids, max_tokens=None, salt=None):
        if tuple(token_ids) == prompt:
            matched.append(max_tokens)
        return real(tree, token_ids, max_tokens, salt)

    monkeypatch.setattr(PrefixTree, "match", counting)
    res = server.submit(GenerationRequest("q", prompt, max_new_tokens=2))
    server.step()  # admits it and prefills its 100 new tokens in one chunk
    assert len(matched) == 1
    assert res.hit_tokens == 1024 and res.prefill_tokens == 100
    assert res.output_ids == [5]
    server.step()  # a decode step: no match
    assert len(matched) == 1 and res.done and res.output_ids == [5, 5]
    assert len(server.tracker) == 0

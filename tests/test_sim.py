"""The cluster simulator (evals/sim, docs/simulator.md): accounting, hits, timing, CLI.

Small traces built here (block-hash requests as in the Mooncake trace); every run uses
the real control plane and the real policies, so each test also exercises them.
"""

from __future__ import annotations

import json
import random
from array import array
from dataclasses import replace

import pytest
from token_util import common_prefix

from evals.sim.config import SimConfig
from evals.sim.metrics import Recorder
from evals.sim.systems import SYSTEMS, p90_goodput, simulate
from evals.sim.timing import ChunkSchedule, DecodeSchedule, decode_bs1_s, prefill_bs1_s
from evals.sim.trace import arrange, load_trace, prompt_array
from evals.workloads.base import Request
from tokenlake.core.cost_model import LatencyModel

BS = 512


def make_trace(n: int = 24, seed: int = 0, gap_s: float = 0.5, docs: int = 4,
               doc_blocks: tuple[int, int] = (2, 6), tail_blocks: tuple[int, int] = (0, 2),
               out: tuple[int, int] = (1, 24)) -> list[Request]:
    """Requests sharing ``docs`` document prefixes (block ids), then private blocks."""
    rng = random.Random(seed)
    next_id = 10_000
    prefixes = []
    for d in range(docs):
        prefixes.append(tuple(range(d * 100, d * 100 + rng.randint(*doc_blocks))))
    reqs = []
    for i in range(n):
        blocks = list(rng.choice(prefixes))
        for _ in range(rng.randint(*tail_blocks)):
            blocks.append(next_id)
            next_id += 1
        last = rng.randint(1, BS)  # the last block may be partial
        length = (len(blocks) - 1) * BS + last
        reqs.append(Request(f"q{i}", i * gap_s, length, rng.randint(*out),
                            block_hashes=tuple(blocks)))
    return reqs


def shared_prefixes(reqs: list[Request]) -> list[int]:
    """In arrival order, each request's longest prefix shared with an earlier one, with
    at least one token of it left to compute (0 if it shares nothing)."""
    out, earlier = [], []
    for r in sorted(reqs, key=lambda r: r.arrival_s):
        toks = r.tokens()
        out.append(max((common_prefix(e, toks[:-1]) for e in earlier), default=0))
        earlier.append(toks)
    return out


def direct_hit_tokens(reqs: list[Request], c: int, page: int | None = None) -> int:
    """Prefix hits with an unbounded cache and nothing concurrent, at least one token
    left to compute. Without ``page``: every whole ``c``-token segment of the prompt that
    an earlier prompt also had (same tokens before and in it). With ``page``: the longest
    prefix shared with any earlier prompt, in whole pages (the pool keeps every earlier
    prompt: its whole segments, and its last partial segment as a tail)."""
    if page:
        return sum(n // page * page for n in shared_prefixes(reqs))
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for r in sorted(reqs, key=lambda r: r.arrival_s):
        toks = r.tokens()
        segs = [toks[: (i + 1) * c] for i in range(len(toks) // c)]
        n = 0
        while n < len(segs) and n < (len(toks) - 1) // c and segs[n] in seen:
            n += 1
        hits += n * c
        seen.update(segs)
    return hits


SMALL = SimConfig(instances=4, cache_gb=8.0, segment_tokens=256, chunk_tokens=512, tp=2)
BIG = SimConfig(instances=4, cache_gb=60.0, segment_tokens=256, chunk_tokens=512, tp=2)


# -------------------------------------------------------------- every system


@pytest.mark.parametrize("system", SYSTEMS)
def test_every_system_finishes_every_request_and_accounts_tokens(system):
    reqs = make_trace(20, seed=1, gap_s=0.05)
    res = simulate(reqs, system, SMALL)
    assert res.requests == len(reqs)
    assert res.generated_tokens == sum(r.output_length for r in reqs)
    assert res.input_tokens == sum(r.input_length for r in reqs)
    assert res.prefill_tokens + res.hit_tokens == res.input_tokens
    assert 0 <= res.hit_rate <= 1 and res.cv >= 0
    assert res.mean_ttft_s > 0 and res.p90_ttft_s >= 0
    assert 0 <= res.slo_attainment <= 1
    assert res.events > 0 and res.iterations > 0


def test_pooled_hit_accounting_matches_the_control_plane():
    res = simulate(make_trace(30, seed=2, gap_s=0.05), "tokenlake", SMALL)
    assert res.extra["control_plane_hit_rate"] == pytest.approx(res.hit_rate, abs=1e-12)


# ----------------------------------------------------------------- hit rate


@pytest.mark.parametrize("system", ["tokenlake", "sglang-router"])
def test_hit_rate_equals_a_direct_count_with_an_unbounded_cache(system):
    """Arrivals far apart (each request is done before the next comes), a cache that
    holds everything: TokenLake's pool hits whole segments and pages, SGLang's radix cache hits
    any token prefix its worker holds -- both equal to a direct count."""
    reqs = make_trace(24, seed=3, gap_s=30.0)
    c = BIG.segment_tokens
    res = simulate(reqs, system, BIG)
    if system == "tokenlake":
        assert res.hit_tokens == direct_hit_tokens(reqs, c, page=16)
        assert direct_hit_tokens(reqs, c, page=16) > direct_hit_tokens(reqs, c)
    else:
        # One worker caches everything: with TP=4 the cluster is a single worker.
        one = SimConfig(instances=4, cache_gb=60.0, segment_tokens=c, tp=4)
        res = simulate(reqs, system, one)
        assert res.hit_tokens == direct_hit_tokens(reqs, 1)
    assert res.hit_tokens > 0


def test_banaserve_hits_any_cached_prefix_whatever_worker_serves_it():
    """The global store (issue #20's baseline): with a store that holds everything and
    requests far apart, every request hits its longest cached prefix at token
    granularity, on whichever of the two workers load-based routing picks; each hit's KV
    is fetched, and that time is charged to the request's first chunk."""
    from evals.sim.systems import make_backend

    reqs = make_trace(24, seed=3, gap_s=30.0)
    res = simulate(reqs, "banaserve", BIG)
    assert res.extra["workers"] == 2
    assert res.hit_tokens == direct_hit_tokens(reqs, 1) > 0
    hits = [n for n in shared_prefixes(reqs) if n]
    assert res.extra["kv_fetches"] == len(hits) and sum(hits) == res.hit_tokens
    backend = make_backend("banaserve", BIG)
    assert res.extra["kv_fetch_s"] == pytest.approx(sum(backend.fetch_s_of(n) for n in hits))


def test_banaserve_charges_the_prefix_fetch_to_the_first_token(monkeypatch):
    """Layer-wise prefetch hides a fetch behind compute only partly: the second request
    on a document waits at least one layer's share of the fetch beyond its compute."""
    from evals.sim.global_store import GlobalStoreBackend

    doc = tuple(range(24))
    reqs = [Request("a", 0.0, 24 * BS, 2, block_hashes=doc),
            Request("b", 30.0, 24 * BS, 2, block_hashes=doc)]
    fetched = simulate(reqs, "banaserve", BIG)
    fetch_s = fetched.extra["kv_fetch_s"]
    assert fetched.extra["kv_fetches"] == 1 and fetch_s > 0
    monkeypatch.setattr(GlobalStoreBackend, "fetch_s_of", lambda self, n: 0.0)
    free = simulate(reqs, "banaserve", BIG)
    assert free.hit_tokens == fetched.hit_tokens
    layers = BIG.resolve().model.num_layers
    gap = (fetched.mean_ttft_s - free.mean_ttft_s) * 2  # b's TTFT; a's is the same
    assert gap >= fetch_s / layers * (1 - 1e-9)


def test_concurrent_arrivals_reuse_what_is_already_stored():
    """First come first served, two requests on one 12-block document arriving together:
    the second may only reuse segments the first has already stored, so it hits less
    than with a gap."""
    fcfs = replace(BIG, admission="fcfs")
    doc = tuple(range(12))
    a = Request("a", 0.0, 12 * BS, 4, block_hashes=doc)
    b = Request("b", 0.0, 12 * BS, 4, block_hashes=doc)
    together = simulate([a, b], "tokenlake", fcfs)
    later = simulate([a, Request("b", 30.0, 12 * BS, 4, block_hashes=doc)], "tokenlake", fcfs)
    assert later.hit_tokens == (12 * BS - 1) // 16 * 16  # whole segments, then pages
    assert together.hit_tokens < later.hit_tokens
    # Arriving while the first is half way through its prompt: it reuses what is
    # stored by then (the first request's plan is settled to show it), not more.
    half = simulate([a, Request("b", 0.05, 12 * BS, 4, block_hashes=doc)], "tokenlake", fcfs)
    assert 0 < half.hit_tokens < later.hit_tokens


@pytest.mark.parametrize("gap", [0.0, 0.05])
def test_cache_first_admission_waits_for_a_prefix_in_flight(gap):
    """Cache-first (the default): the second request on the document waits for the
    segments the first computes and hits all of them, as if it came later; first come
    first served it is admitted at once and computes them again."""
    doc = tuple(range(12))
    a = Request("a", 0.0, 12 * BS, 4, block_hashes=doc)
    b = Request("b", gap, 12 * BS, 4, block_hashes=doc)
    waited = simulate([a, b], "tokenlake", BIG)
    assert waited.hit_tokens == (12 * BS - 1) // 16 * 16
    fcfs = simulate([a, b], "tokenlake", replace(BIG, admission="fcfs"))
    assert fcfs.hit_tokens < waited.hit_tokens


@pytest.mark.parametrize("system", ["tokenlake", "sglang-router", "mooncake-1p3d"])
def test_closed_sessions_send_the_next_turn_after_the_answer(system):
    """Turn 2 extends turn 1's prompt and is timed to arrive with it: in a closed loop
    it is sent when turn 1 has finished, so it reuses turn 1's whole prompt; replayed
    open-loop it arrives while turn 1 computes and reuses less."""
    doc = tuple(range(12))
    t1 = Request("s-0", 0.0, 12 * BS, 4, block_hashes=doc, session_id="s", turn=0)
    t2 = Request("s-1", 0.01, 14 * BS, 4, block_hashes=doc + (50, 51), session_id="s", turn=1)
    # One router worker; TokenLake first come first served (cache-first admission would
    # hold the open-loop turn 2 for turn 1's segments: the test above).
    cfg = replace(BIG, tp=4) if system == "sglang-router" else replace(BIG, admission="fcfs")
    closed = simulate([t1, t2], system, cfg)
    opened = simulate([t1, t2], system, replace(cfg, closed_sessions=False))
    want = 12 * BS if system != "tokenlake" else 12 * BS // 256 * 256
    assert closed.hit_tokens == want
    assert opened.hit_tokens < closed.hit_tokens
    assert closed.mean_ttft_s < opened.mean_ttft_s  # TTFT counts from when it was sent


def test_admission_recounts_when_finding_a_hit_settles_another_admission():
    """Finding a queued request's hit can settle another plan, which admits (or takes
    back) requests while admission is counting: the count starts over on the new
    state instead of failing on the changed queue or double-booking the pool."""
    from evals.sim.backend import SimRequest
    from evals.sim.systems import make_backend

    b = make_backend("tokenlake", SMALL)
    reqs = [SimRequest(i, r) for i, r in enumerate(make_trace(4, seed=3, gap_s=0.0))]
    for r in reqs:
        b.tracker.add(r)
        b.on_arrival(r)
    first, later = reqs[0], reqs[2]
    real_hit, calls = b.planner.ready_hit, []

    def settling_hit(r, start=0):
        calls.append(r.request_id)
        if len(calls) == 1:  # as a settle of a computed plan does: `later` is admitted
            b.admit(later)
        return real_hit(r, start)

    b.planner.ready_hit = settling_hit
    out = b._admissible()
    assert calls.count(first.request_id) == 2  # counted again after the settle
    assert later.admitted and later not in list(b.tracker.waiting())
    assert list(b.tracker.running()) == [later]
    assert [r.request_id for r in out] == [later.request_id] + [r.request_id for r in reqs if r is not later]
    assert len(out) == len({id(r) for r in out})  # nobody counted twice


def test_workers_admit_first_come_first_served_like_sglang():
    """A baseline worker admits new requests in arrival order and stops at the first
    that does not fit (as SGLang's scheduler does, and as TokenLake's admission does):
    a later small request does not pass it. Admitted prefills go on regardless."""
    from evals.sim.backend import SimRequest
    from evals.sim.unpooled import Worker, admit_in_order
    from tokenlake.generation.tracker import RequestTracker

    tracker = RequestTracker(chunk_tokens=BS)

    def req(i, n):
        r = SimRequest(i, Request(f"r{i}", 0.0, n, 8, block_hashes=tuple(range(100 * i, 100 * i + n // BS))))
        r.tokens = prompt_array(r.source)
        return tracker.add(r)

    w = Worker(6 * BS, tracker)
    running, big, small = req(0, 2 * BS), req(1, 5 * BS), req(2, BS)
    assert admit_in_order(w, [running]) == [running]
    assert admit_in_order(w, [big, running, small]) == [running]
    assert big.blocked == small.blocked == "memory" and not small.admitted
    w.admitted.discard(running)  # it left: memory is free again
    big.blocked = small.blocked = None
    assert admit_in_order(w, [big, small]) == [big]
    assert small.blocked == "memory"


# -------------------------------------------------------------------- timing


def test_ttft_is_at_least_the_modelled_prefill_time():
    lat = LatencyModel.load("a100-80gb_llama-2-7b")
    reqs = make_trace(16, seed=4, gap_s=0.02)
    for system in ("tokenlake", "sglang-router", "mooncake-3p1d"):
        res = simulate(reqs, system, BIG)
        assert res.requests == len(reqs)
        # Every prompt needs at least one iteration: the fixed per-iteration cost.
        assert res.mean_ttft_s >= lat.c_const
    # A request alone on one TP=1 worker: TTFT is exactly its chunked prefill.
    one = Request("solo", 0.0, 3000, 2, token_ids=tuple(range(3, 3003)))
    cfg = SimConfig(instances=1, cache_gb=60.0, tp=1, chunk_tokens=512)
    res = simulate([one], "round-robin", cfg)
    assert res.mean_ttft_s == pytest.approx(prefill_bs1_s(lat, 3000, 512), rel=1e-9)
    assert res.mean_tbt_s == pytest.approx(decode_bs1_s(lat, 3000), rel=1e-9)
    assert res.slo_attainment == 1.0 and res.cv == 0.0  # alone: 1x its own time; one worker
    strict = simulate([one], "round-robin", replace(cfg, slo_scale=0.99))
    assert strict.slo_attainment == 0.0 and strict.ttft_slo_attainment == 0.0
    # TokenLake spreads the prompt over the instances (elastic DoP): faster than one
    # instance, never faster than perfect parallelism.
    pooled = simulate([one], "tokenlake", replace(cfg, instances=4))
    alone = prefill_bs1_s(lat, 3000, 512)
    assert alone / 4 <= pooled.mean_ttft_s < alone


def test_p90_goodput_is_the_highest_rate_meeting_the_slo():
    base = make_trace(24, seed=8, gap_s=0.0)
    best, results = p90_goodput(lambda rate: arrange(base, rate=rate, seed=2), [0.05, 500.0],
                                "tokenlake", replace(SMALL, slo_scale=2.0))
    assert [r.slo_attainment >= 0.9 for r in results] == [True, False]
    assert best == 0.05


def test_decode_schedule_matches_step_by_step_sums():
    s = DecodeSchedule(2.0, 0.01, 0.001, 50)
    t = 2.0
    for j in range(1, 51):
        t += 0.01 + 0.001 * (j - 1)
        assert s.end(j) == pytest.approx(t)
    assert s.steps_done_by(s.end(17)) == 17
    assert s.steps_done_by(s.end(17) - 1e-9) == 16
    assert s.first_end_at_or_after(s.end(17) - 1e-9) == 17
    lazy = ChunkSchedule(1.0, fn=lambda j: 0.5 * j, k_max=6)
    assert lazy.first_end_at_or_after(2.0) == 2 and lazy.end(6) == pytest.approx(11.5)


def test_recorded_tbts_equal_the_schedule_durations():
    rec = Recorder([0], 1.0)

    class R:  # a request as the recorder sees it
        tbt_sum = tbt_max = 0.0
        tbt_count = 0
        last_token_s = 2.0

    r = R()
    s = DecodeSchedule(2.0, 0.01, 0.002, 10)
    rec.gap(r, s.end(1))
    rec.steps(s, 2, 10, [r])
    durations = [s.duration(j) for j in range(1, 11)]
    assert r.tbt_count == 10 and r.tbt_sum == pytest.approx(sum(durations))
    assert r.tbt_max == pytest.approx(max(durations)) and r.last_token_s == pytest.approx(s.end(10))
    vals, wts = rec.tbt_samples()
    assert sorted(vals.tolist()) == pytest.approx(sorted(durations))


def test_more_load_means_longer_latency():
    base = make_trace(30, seed=5, gap_s=0.0)
    slow = simulate(arrange(base, rate=0.5, seed=1), "tokenlake", SMALL)
    fast = simulate(arrange(base, rate=50.0, seed=1), "tokenlake", SMALL)
    assert fast.mean_ttft_s > slow.mean_ttft_s


# ------------------------------------------------------------- determinism


@pytest.mark.parametrize("system", ["tokenlake", "sglang-router", "mooncake-1p3d"])
def test_results_are_deterministic_for_a_seed(system):
    reqs = arrange(make_trace(20, seed=6), rate=8.0, seed=3)
    keys = ("hit_rate", "cv", "mean_ttft_s", "mean_tbt_s", "p90_tbt_s", "slo_attainment",
            "events", "iterations")
    a = simulate(reqs, system, SMALL).to_dict()
    b = simulate(reqs, system, SMALL).to_dict()
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


# ------------------------------------------------------------------ traces


def test_prompt_array_equals_request_tokens_and_trace_tools(tmp_path):
    r = Request("x", 0.0, 1000, 3, block_hashes=(7, 4_194_304))
    assert prompt_array(r) == array("i", r.tokens())
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": 1000 * i, "input_length": 600,
                                          "output_length": 2, "hash_ids": [i, 99]})
                              for i in range(5)))
    reqs = load_trace(path, limit=4)
    assert [q.arrival_s for q in reqs] == [0.0, 1.0, 2.0, 3.0]
    assert [q.arrival_s for q in arrange(reqs, speedup=2.0)] == [0.0, 0.5, 1.0, 1.5]
    twice = arrange(reqs, times=2)
    assert len(twice) == 8 and len({q.request_id for q in twice}) == 8
    assert twice[4].arrival_s == pytest.approx(4.0)  # one mean gap after the first copy
    assert twice[4].block_hashes == reqs[0].block_hashes  # later copies re-ask the same blocks
    poisson = arrange(reqs, rate=4.0, seed=1)
    assert [q.request_id for q in poisson] == [q.request_id for q in reqs]  # trace order kept
    assert all(a.arrival_s < b.arrival_s for a, b in zip(poisson, poisson[1:]))
    with pytest.raises(ValueError, match="not both"):
        arrange(reqs, rate=1.0, speedup=2.0)
    path.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_trace(path)


# --------------------------------------------------------------------- CLI


def test_tokenlake_sim_cli_prints_json(tmp_path, capsys):
    from tokenlake.tools.cli import main

    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": 200 * i, "input_length": r.input_length,
                                          "output_length": r.output_length,
                                          "hash_ids": list(r.block_hashes)})
                              for i, r in enumerate(make_trace(12, seed=7))))
    code = main(["sim", "--trace", str(path), "--instances", "4", "--system", "sglang-router",
                 "--cache-gb", "8", "--speedup", "2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 12 and out["system"] == "sglang-router"
    for key in ("hit_rate", "cv", "mean_ttft_s", "mean_tbt_s", "slo_attainment", "sim_wall_s",
                "events_per_s"):
        assert key in out


def test_tokenlake_sim_cli_rejects_bad_arguments(tmp_path, capsys):
    from tokenlake.tools.cli import main

    assert main(["sim", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    for bad in (["--instances", "0"], ["--cache-gb", "-1"], ["--system", "vllm"],
                ["--rate", "1", "--speedup", "2"]):
        with pytest.raises(SystemExit) as exc:
            main(["sim", "--trace", str(path), *bad])
        assert exc.value.code == 2
    assert main(["sim", "--trace", str(path), "--cache-gb", "0.0001", "--json"]) == 2
    assert "segment" in capsys.readouterr().err


def test_a_disk_tier_keeps_what_the_pool_evicts():
    """A pool too small for the documents: without a tier, evicted segments are
    computed again; with one, they come back (promoted, their read charged), so the
    pool hits at least every whole segment an unbounded cache would (a pool this size
    has room for a request's promotions; a tinier one may not, and computes the rest)."""
    reqs = make_trace(30, seed=4, gap_s=30.0, docs=8, doc_blocks=(4, 6))
    small = SimConfig(instances=4, cache_gb=2.4, segment_tokens=256, chunk_tokens=512, tp=2)
    bare = simulate(reqs, "tokenlake", small)
    tiered = simulate(reqs, "tokenlake", replace(small, tier_gb=10.0))
    tier = tiered.extra["tier"]
    assert bare.extra["tier"] is None and tier["slots_per_instance"] > 0
    assert tier["promoted"] > 0 and tier["promote_s"] > 0 and tier["demotions"] > 0
    assert tiered.hit_tokens >= direct_hit_tokens(reqs, 256) > bare.hit_tokens
    assert tiered.extra["control_plane_hit_rate"] == pytest.approx(tiered.hit_rate, abs=1e-12)

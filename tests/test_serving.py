"""End to end: a model whose every prefix attention is served by the pool generates
exactly what a plain engine with a local KV cache generates (issue #4).

The serving mechanics (scheduling, admission, batching, refusals) run the small Llama of
tests/tiny_model.py (reference answers computed once per run and checked for clear
margins), in pools of as many segments as the SmolLM2 pools of the same tests held
(``SLOTS``); SmolLM2-135M itself still generates through a pool of two instances (the
shipped model's numbers through the pool) and answers the second chat turn (its answer,
decoded and templated again, must come back as a hit)."""

from __future__ import annotations

import contextlib

import pytest
from tiny_model import check_margins, model_spec, pool_bytes, reference

from tokenlake.deploy.local import LocalCluster
from tokenlake.generation import BadRequest, GenerationLoop, GenerationRequest
from tokenlake.model.llama.reference import GenerationResult

C = 16
NEW = 6
#: segments per instance of the pools below: what 48, 16 and 8 MiB held of SmolLM2
SLOTS_48M, SLOTS_16M, SLOTS_8M = 68, 22, 11


@pytest.fixture(scope="module")
def model(tiny_llama):
    """The tiny model, the shipped tokenizer and the tiny model's cached reference."""
    return tiny_llama


def _same(result, want: GenerationResult) -> None:
    """Token-identical to the reference; every kept step's logits within 1e-4."""
    assert result.output_ids == list(want.output_ids)
    if result.logits:
        assert len(result.logits) == len(want.logits)
    for got, exp in zip(result.logits, want.logits):
        assert (got - exp).abs().max().item() < 1e-4


def _prompts(tok):
    system = {"role": "system", "content": "You are a concise assistant. Answer in a few words."}
    doc = "The river Lumen runs 212 kilometres from the Grey Hills to the sea at Kestrel Bay."
    qs = ["How long is the river Lumen?", "Where does the river Lumen end?", "Name the hills it starts in."]
    return [tuple(tok.apply_chat_template([system, {"role": "user", "content": f"{doc}\n{q}"}])) for q in qs]


def serve_two_waves(cluster, weights, tok, prompts):
    """The first prompt alone puts the shared prefix into the pool; the others reuse it.
    Returns the server's results (``p0``, ``p1``, ...), every step's logits kept."""
    server = GenerationLoop(cluster, weights, chunk_tokens=64, keep_logits=True)
    server.run([GenerationRequest("p0", prompts[0], NEW, (tok.eos_id,))])
    server.run([GenerationRequest(f"p{i}", p, NEW, (tok.eos_id,)) for i, p in enumerate(prompts[1:], 1)])
    assert server.prefixes_lost == 0, "one client: what a request matched is there at its admission"
    return server.results


@pytest.mark.parametrize("which, n, in_place", [("tiny", 1, True), ("tiny", 2, True), ("tiny", 2, False),
                                                ("tiny", 4, True), ("smollm2", 2, True)])
def test_generation_through_the_pool_equals_the_reference(request, monkeypatch, which, n, in_place):
    """In place (the default on one machine: the compute engine attends the slabs
    itself, the query engines are asked nothing) and through the query engines
    (``TOKENLAKE_QUERY_IN_PLACE=0``: a hand-off on the session's bell per layer)."""
    weights, tok, _ = request.getfixturevalue("tiny_llama" if which == "tiny" else "smollm2")
    ref = reference(weights)
    prompts = _prompts(tok)
    assert any(len(p) % C for p in prompts), "want a prefix that is not a multiple of C"
    monkeypatch.setenv("TOKENLAKE_QUERY_IN_PLACE", "1" if in_place else "0")
    with LocalCluster(n, model_spec(weights), pool_bytes(weights, C, SLOTS_48M), segment_tokens=C,
                      max_rows=512) as cluster:
        results = serve_two_waves(cluster, weights, tok, prompts)
        asked = sum(p.handoffs for (role, _), p in cluster.engine_stats().items() if role == "query")
    assert (asked == 0) == in_place, asked
    for i, prompt in enumerate(prompts):
        _same(results[f"p{i}"], ref.generate(list(prompt), NEW, stop_ids=(tok.eos_id,)))
    assert results["p1"].hit_tokens > 0 and results["p1"].hit_tokens % C == 0


def test_a_near_tie_of_the_tiny_model_fails_loudly():
    """The tiny model's reference answers are checked for margins (tests/tiny_model.py):
    a step whose two best logits lie within 1e-2 of the largest is refused."""
    import torch

    clear = GenerationResult([0], [torch.tensor([20.0, 10.0, -3.0])], False)
    check_margins(clear)
    tie = GenerationResult([0, 1], [torch.tensor([20.0, 10.0, -3.0]), torch.tensor([1.0, 20.0, 19.9])], False)
    with pytest.raises(AssertionError, match="near tie at step 1"):
        check_margins(tie)


def test_second_turn_prefills_only_its_new_tokens(smollm2):
    """SmolLM2 (its text answer, templated again, must tokenize back to what it generated,
    which a random model's tokens need not)."""
    weights, tok, _ = smollm2
    spec = model_spec(weights)
    with LocalCluster(2, spec, pool_bytes(weights, C, SLOTS_48M), segment_tokens=C, max_rows=512) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=64)
        turn1 = [{"role": "user", "content": "Give me a name for a small grey cat."}]
        p1 = tuple(tok.apply_chat_template(turn1))
        r1 = server.run([GenerationRequest("t1", p1, NEW, (tok.eos_id,))])["t1"]
        answer = tok.decode([t for t in r1.output_ids if t != tok.eos_id])
        p2 = tuple(tok.apply_chat_template(turn1 + [{"role": "assistant", "content": answer},
                                                    {"role": "user", "content": "And one for a dog?"}]))
        r2 = server.run([GenerationRequest("t2", p2, NEW, (tok.eos_id,))])["t2"]
    # What the pool holds of turn 1: its prompt and the outputs fed back (all but the
    # last), in whole segments, as far as turn 2's prompt agrees with them.
    history = list(p1) + r1.output_ids[:-1]
    common = next((i for i, (a, b) in enumerate(zip(history, p2)) if a != b), min(len(history), len(p2)))
    assert r2.hit_tokens == common // C * C > 0
    assert r2.prefill_tokens == len(p2) - r2.hit_tokens


def test_bad_requests_are_refused_and_others_are_served(model):
    weights, tok, ref = model
    spec = model_spec(weights)
    with LocalCluster(1, spec, pool_bytes(weights, C, SLOTS_16M), segment_tokens=C, max_rows=256) as cluster:
        with pytest.raises(ValueError, match="max_rows"):
            GenerationLoop(cluster, weights, chunk_tokens=512)
        server = GenerationLoop(cluster, weights, chunk_tokens=128, keep_logits=True)
        good = tuple(tok.apply_chat_template([{"role": "user", "content": "Say hello."}]))
        server.submit(GenerationRequest("good", good, 4, (tok.eos_id,)))
        with pytest.raises(BadRequest, match="empty"):
            server.submit(GenerationRequest("empty", (), 4))
        with pytest.raises(BadRequest, match="outside"):
            server.submit(GenerationRequest("oov", (1, weights.config.vocab_size + 5), 4))
        with pytest.raises(BadRequest, match="context"):
            server.submit(GenerationRequest("long", good, weights.config.max_context))
        with pytest.raises(BadRequest, match="already"):
            server.submit(GenerationRequest("good", good, 4))
        results = server.run()
    assert set(results) == {"good"}
    _same(results["good"], ref.generate(list(good), 4, stop_ids=(tok.eos_id,)))


def test_goodput_scheduler_drives_the_server_and_output_is_unchanged(model):
    """The DP scheduler decides batches, phases and DoPs; the server runs exactly those
    (prefill and decode in separate batches, prefill spread over several instances when
    the latency model says it pays), and greedy output still equals the reference."""
    from scheduler.goodput import GoodputScheduler
    from tokenlake.core.cost_model import LatencyModel

    weights, tok, ref = model
    spec = model_spec(weights)
    # Token work dominates: splitting a prefill over k instances divides it, so the DP
    # must choose DoP > 1 for prefill batches when instances are free.
    latency = LatencyModel(c_const=1e-3, c_new=1e-3, c_new_prefix=0.0, c_new_sq=0.0,
                           c_prefix=1e-6, c_request=1e-4)
    prompts = _prompts(tok)
    with LocalCluster(3, spec, pool_bytes(weights, C, SLOTS_48M), segment_tokens=C, max_rows=512) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=32, keep_logits=True,
                        policy=GoodputScheduler(chunk_tokens=32), latency=latency, compute_slots=3)
        # Alone, a prefill is best split over every instance; then three run together.
        server.run([GenerationRequest("g0", prompts[0], NEW, (tok.eos_id,))])
        server.run([GenerationRequest(f"g{i}", p, NEW, (tok.eos_id,)) for i, p in enumerate(prompts[1:], 1)])
        results = server.results
    decisions = [d for d in server.decisions if d is not None]
    assert server.compute_slots == 3 and len(decisions) == server.iterations
    batches = [b for d in decisions for b in d.batches]
    assert decisions[0].batches[0].phase == "prefill" and decisions[0].batches[0].dop == 3
    assert any(b.phase == "decode" for b in batches)
    assert all(b.dop == 1 for b in batches if b.phase == "decode")
    assert all(sum(d.dops) <= 3 for d in decisions)
    for i, prompt in enumerate(prompts):
        _same(results[f"g{i}"], ref.generate(list(prompt), NEW, stop_ids=(tok.eos_id,)))


def test_a_policy_that_schedules_nothing_is_an_error_not_a_hang(model):
    from scheduler.api import Decision
    from tokenlake.core.cost_model import LatencyModel

    class Idle:
        name = "idle"

        def schedule(self, snap):
            return Decision(())

    weights, tok, _ = model
    spec = model_spec(weights)
    latency = LatencyModel(1e-3, 1e-3, 0.0, 0.0, 0.0, 0.0)
    with LocalCluster(1, spec, pool_bytes(weights, C, SLOTS_16M), segment_tokens=C, max_rows=128) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=64, policy=Idle(), latency=latency)
        server.submit(GenerationRequest("x", _prompts(tok)[0], 2, ()))
        with pytest.raises(RuntimeError, match="scheduled nothing"):
            server.step()


def test_one_local_compute_engine_runs_one_batch_per_phase(model):
    """By default the policy sees two slots on a LocalCluster (one compute engine runs
    every batch in turn): a prefill and a decode batch may share an iteration, and the
    DoP 1 batches of a phase run as one: decode requests are batched together."""
    from tokenlake.generation.live import one_per_phase

    weights, tok, ref = model
    spec = model_spec(weights)
    prompts = _prompts(tok)
    with LocalCluster(2, spec, pool_bytes(weights, C, SLOTS_48M), segment_tokens=C, max_rows=512) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=64, keep_logits=True)
        assert server.compute_slots == 2
        server.run([GenerationRequest(f"o{i}", p, 3, ()) for i, p in enumerate(prompts)])
        with pytest.raises(ValueError):
            GenerationLoop(cluster, weights, compute_slots=3)
    ran = [one_per_phase(d.batches) for d in server.decisions]
    assert all(len({b.phase for b in r}) == len(r) for r in ran)  # one batch per phase
    assert max(len(b.request_ids) for r in ran for b in r if b.phase == "decode") == 3
    for i, p in enumerate(prompts):
        _same(server.results[f"o{i}"], ref.generate(list(p), 3, stop_ids=()))


def test_one_per_phase_joins_the_dop1_batches_of_a_phase_in_order():
    from scheduler.api import BatchDecision as B
    from tokenlake.generation.live import one_per_phase

    got = one_per_phase([B(("a",), "decode", 1, (1,)), B(("p",), "prefill", 2, (64,)),
                         B(("b", "c"), "decode", 1, (1, 1)), B(("q",), "prefill", 1, (32,)),
                         B(("r",), "prefill", 1, (16,))])
    assert got == [B(("a", "b", "c"), "decode", 1, (1, 1, 1)), B(("p",), "prefill", 2, (64,)),
                   B(("q", "r"), "prefill", 1, (32, 16))]


@pytest.mark.parametrize("parallel", [False, True], ids=["one-engine", "engine-per-instance"])
def test_a_new_request_gets_its_first_token_while_another_decodes(model, parallel):
    """The goodput DP on one local engine, or on an engine per instance: a request
    arriving while another decodes is prefilled beside that decode, not after it
    finishes; both answers stay exact."""
    from tokenlake.engines.compute import ParallelComputeEngine

    weights, tok, ref = model
    spec = model_spec(weights)
    prompts = _prompts(tok)
    with LocalCluster(2, spec, pool_bytes(weights, C, SLOTS_48M), segment_tokens=C, max_rows=512) as cluster:
        engine = ParallelComputeEngine(weights, cluster) if parallel else None
        server = GenerationLoop(cluster, weights, chunk_tokens=64, engine=engine, keep_logits=True)
        first = server.submit(GenerationRequest("long", prompts[0], 16, ()))
        while not first.output_ids:
            server.step()
        second = server.submit(GenerationRequest("new", prompts[1], 2, ()))
        while not second.output_ids:
            server.step()
        assert not first.done and len(first.output_ids) < 16
        server.run()
        if engine is not None:
            engine.close()
    _same(first, ref.generate(list(prompts[0]), 16, stop_ids=()))
    _same(second, ref.generate(list(prompts[1]), 2, stop_ids=()))


def test_a_full_pool_makes_new_requests_wait_not_fail(model):
    """Requests that each fit but together overflow the pool: admission waits for a
    finished request's room, nobody fails, every answer is still the reference's."""
    from scheduler.continuous import ContinuousBatching

    weights, tok, ref = model
    spec = model_spec(weights)
    import random

    rng = random.Random(5)  # prompts that share nothing, so nothing is deduplicated
    prompts = [tuple(rng.randrange(17, 49152) for _ in range(50)) for _ in range(4)]
    with LocalCluster(1, spec, pool_bytes(weights, C, SLOTS_8M), segment_tokens=C, max_rows=512) as cluster:
        slots = cluster.control.stats().pool.slots_capacity[0]
        need = [-(-(len(p) + NEW) // C) for p in prompts]
        assert max(need) <= slots < sum(need), (need, slots)  # alone yes, together no
        server = GenerationLoop(cluster, weights, policy=ContinuousBatching(256), compute_slots=1, keep_logits=True)
        results = server.run([GenerationRequest(f"f{i}", p, NEW, ()) for i, p in enumerate(prompts)])
        assert server.admission_holds > 0, "the pool was full at least once"
        # admissions taken back count nothing: each prompt token once, as a hit or computed
        assert [r.hit_tokens + r.prefill_tokens for r in (results[f"f{i}"] for i in range(4))] == \
            [len(p) for p in prompts]
        cluster.control.check()
        assert cluster.control.live_requests == ()
    for i, p in enumerate(prompts):
        _same(results[f"f{i}"], ref.generate(list(p), NEW, stop_ids=()))


def test_a_full_pool_offers_admission_to_the_cached_prefix_first(model):
    """With admissions limited (the pool was full), the request whose prompt the pool
    holds goes before an older one that hits nothing, unless the older one has waited
    past its patience (scheduler/admission.py)."""
    weights, tok, ref = model
    spec = model_spec(weights)
    doc = tuple(range(100, 100 + 3 * C))
    now = [0.0]
    with LocalCluster(1, spec, pool_bytes(weights, C, SLOTS_8M), segment_tokens=C, max_rows=512) as cluster:
        server = GenerationLoop(cluster, weights, clock=lambda: now[0])
        server.run([GenerationRequest("doc", doc + (7,), 1, ())])
        server.submit(GenerationRequest("old", tuple(range(300, 340)), 1, ()))
        now[0] = 1.0
        server.submit(GenerationRequest("new", doc + (8, 9), 1, ()))
        server.admit_limit = 1
        assert [v.request_id for v in server.snapshot().requests] == ["new"]
        assert server.snapshot().requests[0].context_tokens == 3 * C
        now[0] = 1.0 + server.admission_patience_s  # "old" waited past its patience
        assert [v.request_id for v in server.snapshot().requests] == ["old"]
        server.admit_limit = None
        server.run()
        cluster.control.check()


@pytest.mark.parametrize("rule", ["keep", "reform"])
def test_decode_batches_on_engines_per_instance_stay_where_they_ran(model, rule):
    """An engine per instance (batches computed in parallel): the goodput DP keeps each
    decode batch on the instance it ran on (the loop passes where each request decoded
    and pins kept batches there); requests arrive one by one, so the stateless DP
    (``reform``) batches them afresh and moves some. The answers are exact either way."""
    from scheduler.goodput import GoodputScheduler
    from tokenlake.engines.compute import ParallelComputeEngine

    weights, tok, ref = model
    spec = model_spec(weights)
    prompts = [tok.encode(f"Item {i}: " + "a blue lantern " * (3 + 5 * i)) for i in range(4)]
    with LocalCluster(2, spec, pool_bytes(weights, C, SLOTS_48M), segment_tokens=C, max_rows=512) as cluster:
        engine = ParallelComputeEngine(weights, cluster)
        try:
            server = GenerationLoop(cluster, weights, chunk_tokens=64, engine=engine,
                                    policy=GoodputScheduler(chunk_tokens=64, decode_batches=rule))
            results = []
            for i, p in enumerate(prompts):
                results.append(server.submit(GenerationRequest(f"r{i}", p, 12, ())))
                for _ in range(3):
                    server.step()
            while server.busy:
                server.step()
        finally:
            engine.close()
    for p, res in zip(prompts, results):
        _same(res, ref.generate(list(p), 12, stop_ids=()))
    moves = server.decode_moves
    assert (moves == 0) if rule == "keep" else (moves > 0), moves


def test_a_prefix_evicted_between_its_match_and_its_admission_is_computed_again(model):
    """Another client's placement may evict what the loop matched for a waiting request
    before it admits it (injected here: the policy, which runs between the two, evicts
    every evictable segment once). The request is neither failed nor is the iteration:
    it goes back to waiting, is admitted without a hit, and answers as the reference."""
    weights, tok, ref = model
    prompts = _prompts(tok)
    with LocalCluster(1, model_spec(weights), pool_bytes(weights, C, SLOTS_16M), segment_tokens=C,
                      max_rows=512) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=64, keep_logits=True)
        server.run([GenerationRequest("p0", prompts[0], NEW, (tok.eos_id,))])
        pool, schedule, evicted = cluster.control.pool, server.policy.schedule, []

        def evicting(snap):
            if not evicted:
                assert [v.context_tokens > 0 for v in snap.waiting] == [True], "p1 matched a prefix"
                while (e := pool.evict_one()) is not None:
                    evicted.append(e)
            return schedule(snap)

        server.policy.schedule = evicting
        results = server.run([GenerationRequest("p1", prompts[1], NEW, (tok.eos_id,))])
        assert evicted and server.prefixes_lost == 1
        assert results["p1"].hit_tokens == 0
        _same(results["p1"], ref.generate(list(prompts[1]), NEW, stop_ids=(tok.eos_id,)))
        cluster.control.check()


def test_an_iteration_that_fails_mid_prefill_counts_its_chunk_once(model):
    """The compute engine fails once, on the second chunk of a prompt (the request is
    running: its first chunk is stored): the step raises, the iteration is undone, and
    the next steps compute that chunk again. The request's answer is the reference's and
    its prompt tokens are counted once (the failed chunk's count was undone)."""
    weights, tok, ref = model
    prompt = _prompts(tok)[0]
    assert len(prompt) > 2 * 16
    with LocalCluster(1, model_spec(weights), pool_bytes(weights, C, SLOTS_16M), segment_tokens=C,
                      max_rows=512) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=16, keep_logits=True)
        run, calls = server.engine.run, []

        def fails_once(plans, batches):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected: the engine failed on the second chunk")
            return run(plans, batches)

        server.engine.run = fails_once
        server.submit(GenerationRequest("r", prompt, NEW, (tok.eos_id,)))
        with pytest.raises(RuntimeError, match="injected"):
            while server.tracker:
                server.step()
        result = server.run()["r"]
        assert len(calls) > 2 and result.hit_tokens == 0
        assert result.prefill_tokens == len(prompt)
        _same(result, ref.generate(list(prompt), NEW, stop_ids=(tok.eos_id,)))
        cluster.control.check()


@contextlib.contextmanager
def _one_slot_decoding(weights, prompt, new_tokens: int, chunk_tokens: int, tokens: int = 1):
    """A loop on a one-instance pool (one compute slot) whose request ``long`` has
    decoded ``tokens`` tokens of ``new_tokens``: yields ``(cluster, server, its result)``."""
    with LocalCluster(1, model_spec(weights), pool_bytes(weights, C, SLOTS_48M), segment_tokens=C,
                      max_rows=512) as cluster:
        server = GenerationLoop(cluster, weights, chunk_tokens=chunk_tokens)
        long = server.submit(GenerationRequest("long", prompt, new_tokens, ()))
        while len(long.output_ids) < tokens:
            server.step()
        yield cluster, server, long


def test_one_compute_slot_admits_a_request_that_arrives_while_another_decodes(model):
    """A loop on one instance (one compute slot, the default policy, no TBT SLO): a
    request that arrives while another decodes gets its first token within a few
    iterations, the other still decoding (the phases take turns; the DP alone runs no
    prefill while anything decodes, so it waited for the other to end). Both answers
    equal the reference."""
    weights, tok, _ = model
    ref = reference(weights)
    prompts = _prompts(tok)
    other = tuple(tok.apply_chat_template([{"role": "user", "content": (
        "Kestrel Bay is a wide harbour of grey stone where boats from the north islands land "
        "their catch each morning before the markets open. What do the boats bring?")}]))
    long_new = 40
    with _one_slot_decoding(weights, prompts[0], long_new, 32, tokens=3) as (_, server, first):
        second = server.submit(GenerationRequest("new", other, NEW, (tok.eos_id,)))
        steps = 0
        while not second.output_ids:
            server.step()
            steps += 1
        chunks = -(-second.prefill_tokens // 32)
        assert not first.done and len(first.output_ids) < long_new
        assert chunks >= 2 and steps <= 2 * chunks - 1, (steps, chunks)  # a chunk every other iteration
        assert len(first.output_ids) == 3 + chunks - 1  # ... and one decode step between two
        while server.busy:
            server.step()
    _same(first, ref.generate(list(prompts[0]), long_new, stop_ids=()))
    _same(second, ref.generate(list(other), NEW, stop_ids=(tok.eos_id,)))


def test_a_prefill_turn_that_runs_nothing_hands_the_turn_back_to_the_decodes(model):
    """One compute slot: a request arrives whose prompt another client of the pool is
    still storing, so its prefill turn plans nothing (it waits for that segment). The
    decode that runs beside it is not held up meanwhile: its turn comes back at once.
    Once the other client gives up, the new request computes the prompt itself."""
    from tokenlake.core.plans import Batch, BatchRequest

    weights, tok, _ = model
    ref = reference(weights)
    base, other = _prompts(tok)[0], _prompts(tok)[1]
    with _one_slot_decoding(weights, base, 40, 512) as (cluster, server, long):
        cp = cluster.control  # another client: it places the prompt's segments, stores nothing yet
        theirs = cp.gen_plans([Batch((BatchRequest("theirs", tuple(other)),))], [1])
        new = server.submit(GenerationRequest("new", other, NEW, (tok.eos_id,)))
        before = len(long.output_ids)
        for _ in range(6):
            server.step()
        assert not new.output_ids, "its prompt's segments are still being stored elsewhere"
        assert len(long.output_ids) - before >= 3, "the decode took every other step at least"
        cp.abort(theirs)  # that client went: the request stores the segments itself
        while server.busy:
            server.step()
    _same(new, ref.generate(list(other), NEW, stop_ids=(tok.eos_id,)))
    _same(long, ref.generate(list(base), 40, stop_ids=()))


def test_one_compute_slot_starves_neither_phase_under_steady_arrivals(model):
    """The phases' turns cannot lock either one out: with one compute slot and a new
    request arriving at every iteration, the request that decodes gains a token at least
    every other iteration, and every arrival gets its first token within a bounded
    number of iterations (its chunks, each beside at most one decode turn), then ends.
    Every answer equals the reference."""
    weights, tok, _ = model
    ref = reference(weights)
    base = _prompts(tok)[0]
    with _one_slot_decoding(weights, base, 60, 32) as (_, server, long):
        arrivals, first, before = [], {}, len(long.output_ids)

        def step() -> None:
            server.step()
            for k, (_, result, _) in enumerate(arrivals):
                if result.output_ids:
                    first.setdefault(k, server.iterations)

        for i in range(24):
            prompt = tuple(tok.encode(f"Arrival {i}: {' '.join(['word'] * (20 + 3 * i))}"))
            arrivals.append((prompt, server.submit(GenerationRequest(f"a{i}", prompt, 3, ())), server.iterations))
            step()
            if i % 2:  # two iterations: the decoder's turn came at least once
                assert len(long.output_ids) > before or long.done, i
                before = len(long.output_ids)
        while server.busy:
            step()
    chunks = 0  # an arrival waits for the chunks of those before it, each beside one decode turn
    for k, (prompt, result, arrived) in enumerate(arrivals):
        chunks += -(-len(prompt) // 32)
        assert first[k] - arrived <= 2 * chunks + 2, (k, first[k] - arrived, chunks)
        _same(result, ref.generate(list(prompt), 3, stop_ids=()))
    _same(long, ref.generate(list(base), 60, stop_ids=()))

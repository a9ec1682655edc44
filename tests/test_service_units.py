"""The parts of the HTTP service that need no model: sampling, the incremental
detokenizer with stop strings (linear in the output), the request bodies, and the engine
loop's threading (submit, stream, cancel, a failed iteration, a request failing alone,
shutdown) over a scripted backend."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenlake.generation.requests import BadRequest, GenerationRequest, RequestResult
from tokenlake.generation.sampling import MIN_TEMPERATURE, SamplingError, SamplingParams, next_token
from tokenlake.service.generation_thread import (
    EngineFailed,
    GenerationThread,
    LoopClosed,
    RequestFailed,
)
from tokenlake.service.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    Detokenizer,
    StopMatcher,
)

# ------------------------------------------------------------------ sampling


def test_greedy_is_argmax_and_needs_no_generator():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert SamplingParams().generator() is None
    assert next_token(logits, SamplingParams(), None) == 1


def test_top_p_keeps_only_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=1)
    gen = params.generator()
    drawn = {next_token(probs.log(), params, gen) for _ in range(400)}
    assert drawn == {0, 1}, "0.5 + 0.3 reach 0.7: tokens 2 and 3 are never drawn"
    params = SamplingParams(temperature=1.0, top_p=1.0, seed=1)
    gen = params.generator()
    assert {next_token(probs.log(), params, gen) for _ in range(400)} == {0, 1, 2, 3}


def test_a_seed_fixes_the_draws():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.8, seed=42)
    a, b = params.generator(), params.generator()
    assert [next_token(logits, params, a) for _ in range(20)] == \
        [next_token(logits, params, b) for _ in range(20)]


@pytest.mark.parametrize("kw", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_sampling_parameters_out_of_range(kw):
    with pytest.raises(SamplingError):
        SamplingParams(**kw)


@pytest.mark.parametrize("t", [1e-40, 1e-30, MIN_TEMPERATURE / 2])
def test_a_temperature_too_small_to_divide_by_is_greedy(t):
    """1e-40 made ``logits / t`` overflow (softmax NaN, multinomial raised); such
    temperatures are greedy: argmax, no generator."""
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3)) * 30
    params = SamplingParams(temperature=t, seed=1)
    assert params.greedy and params.generator() is None
    assert next_token(logits, params, None) == int(torch.argmax(logits))
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("t", [0.0, 0.7])
def test_logits_no_token_can_be_chosen_from_raise_a_sampling_error(bad, t):
    logits = torch.zeros(50)
    logits[7] = bad
    params = SamplingParams(temperature=t, seed=1)
    with pytest.raises(SamplingError):
        next_token(logits, params, params.generator())


# ------------------------------------------------------------------ detokenizer


def _decode(ids):  # one character per id
    return "".join(chr(i) for i in ids)


def test_stop_string_is_never_sent_even_split_over_tokens():
    d = Detokenizer(_decode, ["END"])
    out = [d.add(ord(c)) for c in "abcEN"]
    assert "".join(out) == "abc", "'EN' may begin the stop: held back"
    assert d.add(ord("D")) == "" and d.stopped and d.text == "abc"


def test_held_back_text_that_is_not_a_stop_comes_out():
    d = Detokenizer(_decode, ["END"])
    assert "".join(d.add(ord(c)) for c in "xEN") == "x"
    assert d.add(ord("o")) == "ENo"
    assert d.flush() == "" and not d.stopped


def test_partial_characters_wait_for_their_bytes():
    d = Detokenizer(lambda ids: "ab\ufffd" if len(ids) == 1 else "abé", [])
    assert d.add(1) == "ab" and d.add(2) == "é"
    d = Detokenizer(lambda ids: "ab\ufffd", [])  # a character never completed
    assert d.add(1) == "ab" and d.flush() == "\ufffd"


@pytest.mark.parametrize("kind,per_token", [("text", 4), ("control", 4), ("broken", 100)])
def test_detokenizing_is_linear_in_the_output(kind, per_token):
    """Each token decodes only the ids since the last character boundary (the former
    detokenizer decoded all of them at every token: 2,000 tokens, 2 million ids), also
    when tokens add no text (control tokens skipped: a model emitting EOS under
    ``ignore_eos``) or never complete a character (bytes that are none: at most
    ``MAX_PENDING`` ids wait)."""
    decoded = []
    ids = {"text": [ord("a") + i % 20 for i in range(2000)], "control": [0] * 2000,
           "broken": [0xFFFD] * 2000}[kind]

    def counting(window):
        decoded.append(len(window))
        return "".join(chr(i) for i in window if i)  # 0: a control token, no text

    d = Detokenizer(counting, ["xyz"])
    text = "".join(d.add(i) for i in ids) + d.flush()
    assert text == counting(ids)
    assert sum(decoded[:-1]) <= per_token * len(ids)


class _Counted(str):
    """A stop string that counts how often a character of it is read."""

    reads = 0

    def __getitem__(self, i):
        _Counted.reads += 1
        return str.__getitem__(self, i)


@pytest.mark.parametrize("stop,text", [("a" * 999 + "b", "a" * 20_000),
                                       ("ab" * 499 + "bb", "ab" * 10_000 + "a"),
                                       ("aab" * 333, "aaba" * 5000)])
def test_stop_matching_reads_each_character_a_bounded_number_of_times(stop, text):
    """Four stops of 1,000 characters that the text keeps almost matching: feeding 20,000
    characters one at a time reads the stops O(text + stops) times, not O(text x stop)
    (the issue's four 200,000-character stops took 15 s for 6 tokens)."""
    _Counted.reads = 0
    m = StopMatcher([_Counted(stop)] * 4)
    assert all(m.feed(c) is None for c in text)
    assert _Counted.reads <= 4 * 4 * (len(stop) + len(text))  # KMP: < 4 reads a character
    assert m.held == max(k for k in range(len(stop)) if text.endswith(stop[:k]))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab", max_size=40), st.lists(st.text(alphabet="ab", min_size=1,
                                                             max_size=6), min_size=1, max_size=4),
       st.lists(st.integers(1, 5), min_size=1, max_size=40))
def test_stop_matcher_finds_what_a_search_finds(text, stops, cuts):
    """Fed in any pieces, the matcher reports the earliest-starting stop among those that
    end in the piece that first completes one, as ``str.find`` on the text so far does."""
    m, fed, i = StopMatcher(stops), "", 0
    for n in cuts * 40:
        piece, i = text[i:i + n], i + n
        if not piece:
            break
        prev, fed = len(fed), fed + piece
        found = m.feed(piece)
        # a stop ending in this piece (none ended earlier: we stopped at the first)
        starts = [fed.find(s, max(0, prev - len(s) + 1)) for s in stops]
        want = min((x for x in starts if x >= 0), default=None)
        assert found == want
        if found is not None:
            break
        assert m.held == max((k for s in stops for k in range(len(s))
                              if fed.endswith(s[:k])), default=0)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 49151), st.sampled_from([1, 2, 0]),
                          st.integers(128, 400)), min_size=1, max_size=30))
def test_incremental_text_is_the_whole_decode_with_the_real_tokenizer(ids):
    """SmolLM2's byte-level tokens (partial characters, control tokens skipped): the
    deltas add up to ``decode(ids)``."""
    from tokenlake.model.llama.tokenizer import load_tokenizer

    tok = load_tokenizer()
    d = Detokenizer(lambda x: tok.decode(x, skip_special_tokens=True), [])
    out = "".join(d.add(i) for i in ids) + d.flush()
    assert out == tok.decode(ids, skip_special_tokens=True)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcE", max_size=30), st.lists(st.text(alphabet="abcE", min_size=1,
                                                              max_size=3), max_size=3))
def test_streamed_text_is_the_text_cut_at_the_first_stop(text, stops):
    d = Detokenizer(_decode, stops)
    sent = ""
    for c in text:
        sent += d.add(ord(c))
        if d.stopped:
            break
    sent += "" if d.stopped else d.flush()
    cuts = [text.find(s) for s in stops if s in text]
    # the earliest stop that completes first ends generation; no stop text is ever sent
    if cuts:
        assert d.stopped and not any(s in sent for s in stops)
        assert text.startswith(sent)
    else:
        assert sent == text


# ------------------------------------------------------------------ request bodies


def test_bodies_validate_and_refuse_what_is_not_served():
    ok = CompletionRequest(model="m", prompt=[1, 2, 3], stop="x")
    assert ok.stops == ["x"] and ok.max_tokens == 16 and ok.temperature == 1.0
    assert CompletionRequest(model="m", prompt=["one"]).prompt == "one"
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 max_completion_tokens=5)
    assert chat.max_tokens == 5
    for bad in ({"n": 2}, {"echo": True}, {"max_tokens": 0}, {"stop": ["a"] * 5},
                {"prompt": []}, {"prompt": ["a", "b"]}, {"logprobs": 2},
                {"prompt": [True]}, {"max_tokens": True}, {"temperature": False},
                {"prompt": "\ud800"}, {"stop": "a\udc00"}, {"model": "\ud800"}):
        with pytest.raises(ValueError):
            CompletionRequest(**{"model": "m", "prompt": "p", **bad})
    assert CompletionRequest(model="m", prompt="snow \u2603 \U0001f600").prompt.endswith("\U0001f600")
    with pytest.raises(ValueError, match="surrogate"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "\udfff"}])


# ------------------------------------------------------------------ engine loop


class Scripted:
    """A backend that emits ``len(prompt)`` tokens per request, one per step for every
    live request (so live requests share steps), and fails a step on demand."""

    def __init__(self) -> None:
        self.on_token = None
        self.results: dict[str, RequestResult] = {}
        self.live: dict[str, GenerationRequest] = {}
        self.fail_next = False
        self.fail_alone: set[str] = set()  # requests that fail on their own at their next step
        self.on_error = None
        self.steps: list[tuple[str, ...]] = []
        self.cancelled: list[str] = []
        self.cancel_seen = threading.Event()
        self.stepped = threading.Event()
        self.gate = threading.Semaphore(0)  # each step waits for a release when gated
        self.gated = False

    @property
    def busy(self) -> bool:
        return bool(self.live)

    def counts(self):
        return 0, len(self.live)

    def submit(self, req):
        if not req.prompt_ids:
            raise BadRequest("empty prompt")
        self.results[req.request_id] = RequestResult(req.request_id, req.prompt_ids)
        self.live[req.request_id] = req

    def step(self):
        if self.gated:
            self.gate.acquire()
        self.steps.append(tuple(self.live))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        for rid, req in list(self.live.items()):
            res = self.results[rid]
            if rid in self.fail_alone:  # as GenerationLoop._emit: retired, finish_reason "error"
                del self.live[rid]
                res.done, res.finish_reason, res.error = True, "error", "SamplingError: NaN"
                self.on_error(rid, res.error)
                continue
            res.output_ids.append(len(res.output_ids))
            if len(res.output_ids) == req.max_new_tokens:
                res.done, res.finish_reason = True, "length"
                del self.live[rid]
            self.on_token(rid, res.output_ids[-1])
        self.stepped.set()

    def cancel(self, rid):
        if self.live.pop(rid, None) is None:
            return False
        self.cancelled.append(rid)
        self.cancel_seen.set()
        self.results[rid].done, self.results[rid].finish_reason = True, "abort"
        return True

    def pop_result(self, rid):
        res = self.results.get(rid)
        return self.results.pop(rid) if res is not None and res.done else None


@pytest.fixture
def loop():
    backend = Scripted()
    lp = GenerationThread(backend).start()
    yield lp, backend
    lp.close()


async def _tokens(stream):
    return [ev.token_id async for ev in stream]


def test_requests_stream_their_tokens_and_share_steps():
    backend = Scripted()
    lp = GenerationThread(backend)

    async def main():
        # both are posted before the thread runs: the first iteration sees both
        subs = [asyncio.ensure_future(lp.submit(GenerationRequest(r, (1,), n)))
                for r, n in (("a", 3), ("b", 2))]
        await asyncio.sleep(0)
        lp.start()
        streams = await asyncio.gather(*subs)
        return await asyncio.gather(*map(_tokens, streams))

    try:
        assert asyncio.run(main()) == [[0, 1, 2], [0, 1]]
    finally:
        lp.close()
    assert backend.steps == [("a", "b"), ("a", "b"), ("a",)], "live requests share steps"
    assert backend.results == {}, "a finished request's result is not kept"


def test_a_refused_request_raises_and_leaves_nothing(loop):
    lp, backend = loop

    async def main():
        with pytest.raises(BadRequest):
            await lp.submit(GenerationRequest("x", (), 3))

    asyncio.run(main())
    assert not backend.live and not backend.results


def test_leaving_the_stream_cancels_the_request(loop):
    lp, backend = loop
    backend.gated = True

    async def main():
        s = await lp.submit(GenerationRequest("c", (1,), 100))
        backend.gate.release()
        async for _ev in s:
            break  # the client went away after one token
    asyncio.run(main())
    backend.gated = False
    backend.gate.release()
    assert backend.cancel_seen.wait(10)
    assert backend.cancelled == ["c"] and not backend.live


def test_a_failed_iteration_ends_its_requests_and_the_loop_goes_on(loop):
    lp, backend = loop
    backend.fail_next = True

    async def main():
        s = await lp.submit(GenerationRequest("d", (1,), 5))
        with pytest.raises(EngineFailed):
            await _tokens(s)
        t = await lp.submit(GenerationRequest("e", (1,), 2))
        return await _tokens(t)

    assert asyncio.run(main()) == [0, 1]
    assert "d" in backend.cancelled


def test_closing_ends_live_requests_and_refuses_new_ones():
    backend = Scripted()
    lp = GenerationThread(backend).start()
    backend.gated = True

    async def main():
        s = await lp.submit(GenerationRequest("f", (1,), 100))
        closer = threading.Thread(target=lp.close)
        closer.start()
        backend.gate.release()  # let the step in progress finish
        with pytest.raises(LoopClosed):
            await _tokens(s)
        closer.join()
        with pytest.raises(LoopClosed):
            await lp.submit(GenerationRequest("g", (1,), 1))

    asyncio.run(main())
    assert backend.cancelled == ["f"]


# ------------------------------------------------------------------ the service's policy


def test_continuous_batching_decodes_everyone_and_packs_the_prefill_budget():
    from scheduler.api import InstanceView, RequestView, Snapshot
    from scheduler.continuous import ContinuousBatching
    from tokenlake.core.cost_model import LatencyModel

    def view(rid, phase, remaining, arrival):
        return RequestView(rid, phase, context_tokens=0, remaining_prefill=remaining,
                           arrival_s=arrival)

    running = (view("d1", "decode", 0, 0.0), view("p1", "prefill", 100, 1.0),
               view("d2", "decode", 0, 0.5))
    waiting = (view("w2", "prefill", 300, 3.0), view("w1", "prefill", 300, 2.0))
    snap = Snapshot(0.0, waiting, running, (InstanceView(0), InstanceView(1)), 0.0,
                    LatencyModel.load("cpu_smollm2-135m"))
    decision = ContinuousBatching(chunk_tokens=512).schedule(snap)
    decision.check(snap)
    prefill, decode = decision.batches
    assert (prefill.phase, prefill.request_ids, prefill.new_tokens) == \
        ("prefill", ("p1", "w1", "w2"), (100, 300, 112))  # running first, then by arrival
    assert (decode.phase, decode.request_ids) == ("decode", ("d1", "d2"))
    one = Snapshot(0.0, waiting, running, (InstanceView(0),), 0.0, snap.latency)
    assert [b.phase for b in ContinuousBatching(512).schedule(one).batches] == ["prefill"]


def test_a_failing_cancel_does_not_kill_the_engine_thread(loop):
    lp, backend = loop
    backend.fail_next = True
    original = backend.cancel

    def cancel(rid):
        if rid == "h":
            raise RuntimeError("cannot cancel")
        return original(rid)

    backend.cancel = cancel

    async def main():
        s = await lp.submit(GenerationRequest("h", (1,), 5))
        with pytest.raises(EngineFailed):
            await _tokens(s)
        t = await lp.submit(GenerationRequest("i", (1,), 2))  # the thread still serves
        return await _tokens(t)

    assert asyncio.run(main()) == [0, 1]


def test_if_the_engine_thread_dies_no_caller_hangs():
    backend = Scripted()
    backend.counts = lambda: 1 / 0  # a bug in the backend, hit after every pass
    lp = GenerationThread(backend).start()

    async def main():
        with pytest.raises((LoopClosed, EngineFailed)):
            s = await lp.submit(GenerationRequest("j", (1,), 3))
            await _tokens(s)
        with pytest.raises(LoopClosed):
            await lp.submit(GenerationRequest("k", (1,), 3))

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        lp.close()


def test_a_backend_that_cannot_queue_a_request_fails_only_that_one(loop):
    lp, backend = loop
    original = backend.submit

    def submit(req):
        if req.request_id == "m":
            raise MemoryError("no room for its cache")
        return original(req)

    backend.submit = submit

    async def main():
        with pytest.raises(EngineFailed, match="MemoryError"):
            await lp.submit(GenerationRequest("m", (1,), 2))
        return await _tokens(await lp.submit(GenerationRequest("n", (1,), 2)))

    assert asyncio.run(main()) == [0, 1]


def test_a_request_failing_on_its_own_fails_alone(loop):
    """The backend reports one request failed (``on_error``): its caller gets
    :class:`RequestFailed`, the request beside it all its tokens, and the loop keeps
    nothing of either."""
    lp, backend = loop
    backend.fail_alone.add("bad")

    async def main():
        bad = await lp.submit(GenerationRequest("bad", (1,), 5))
        good = await lp.submit(GenerationRequest("good", (1,), 4))
        with pytest.raises(RequestFailed, match="SamplingError: NaN"):
            await _tokens(bad)
        return await _tokens(good)

    assert asyncio.run(main()) == [0, 1, 2, 3]
    assert lp.live == 0 and backend.results == {}


def test_closing_a_stream_wakes_its_reader(loop):
    """A reader waiting for the next token returns once its stream is closed (a client
    that hung up while its non-streamed answer was being generated)."""
    lp, backend = loop
    backend.gated = True

    async def main():
        s = await lp.submit(GenerationRequest("w", (1,), 100))
        reader = asyncio.ensure_future(_tokens(s))
        await asyncio.sleep(0)  # one turn of the loop: the reader runs until it waits
        assert not reader.done()  # for its first token (none comes: the backend is gated)
        s.close()
        return await asyncio.wait_for(reader, 10)

    try:
        assert asyncio.run(main()) == []
    finally:  # the engine thread waits in a gated step: let it go
        backend.gated = False
        backend.gate.release()
    assert backend.cancel_seen.wait(10) and backend.cancelled == ["w"]

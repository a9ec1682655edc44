"""Workloads of the evaluation harness: loaders, synthetic generators, arrivals."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

import pytest
from token_util import common_prefix

from evals.workloads import (
    JsonArrayStream,
    Request,
    RequestList,
    WhitespaceTokenizer,
    check_requests,
    load_loogle,
    load_mooncake,
    load_scbench,
    load_sharegpt,
    load_workload,
    mean_rate,
    poisson_arrivals,
    prefix_reuse,
    read_loogle,
    repeat_trace,
    retime,
    scale_rate,
    sharegpt_path,
    synthetic_loogle,
    synthetic_scbench,
    with_poisson_arrivals,
    with_session_arrivals,
)

FIXTURES = Path(__file__).parent / "fixtures"
# the shared data folder sits beside the repository root
MOONCAKE_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / \
    "mooncake_synthetic_trace.jsonl"
WS = WhitespaceTokenizer()


def words(text: str) -> int:
    return len(text.split())


def by_session(requests) -> dict[str, list[Request]]:
    out: dict[str, list[Request]] = defaultdict(list)
    for r in requests:
        if r.session_id is not None:
            out[r.session_id].append(r)
    return out


# ---------------------------------------------------------------- arrivals

def test_poisson_arrivals_rate_and_determinism():
    times = poisson_arrivals(20000, rate=5.0, seed=3)
    assert len(times) == 20000
    assert all(b > a for a, b in zip(times, times[1:]))
    assert times[0] > 0
    assert abs(len(times) / times[-1] - 5.0) / 5.0 < 0.03
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    # exponential gaps: standard deviation equals the mean
    assert abs(statistics.pstdev(gaps) / statistics.fmean(gaps) - 1.0) < 0.05
    assert poisson_arrivals(100, 5.0, seed=3) == times[:100]
    assert poisson_arrivals(100, 5.0, seed=4) != times[:100]
    with pytest.raises(ValueError):
        poisson_arrivals(10, rate=0.0)


def _session_requests() -> list[Request]:
    reqs = []
    for s in range(20):
        for t in reversed(range(4)):  # deliberately listed last turn first
            reqs.append(Request(f"s{s}-t{t}", 0.0, 10 + t, 5, token_ids=tuple(range(10 + t)),
                                session_id=f"s{s}", turn=t))
    reqs += [Request(f"single{i}", 0.0, 3, 1, token_ids=(1, 2, 3)) for i in range(10)]
    return reqs


@pytest.mark.parametrize("shuffle", [True, False])
def test_with_poisson_arrivals_keeps_session_order(shuffle):
    reqs = _session_requests()
    out = with_poisson_arrivals(reqs, rate=2.0, seed=7, shuffle=shuffle)
    assert sorted(r.request_id for r in out) == sorted(r.request_id for r in reqs)
    assert [r.arrival_s for r in out] == poisson_arrivals(len(reqs), 2.0, seed=7)
    check_requests(out)  # sorted, unique, sessions in strict turn order
    for sid, turns in by_session(out).items():
        assert [r.turn for r in turns] == [0, 1, 2, 3], sid
        assert all(b.arrival_s > a.arrival_s for a, b in zip(turns, turns[1:]))
    assert with_poisson_arrivals(reqs, 2.0, seed=7, shuffle=shuffle) == out


def test_with_poisson_arrivals_rejects_repeated_turn():
    reqs = [Request(f"r{i}", 0.0, 2, 1, token_ids=(1, 2), session_id="s", turn=0)
            for i in range(2)]
    with pytest.raises(ValueError, match="turn 0 twice"):
        with_poisson_arrivals(reqs, 1.0)


def test_with_session_arrivals_starts_sessions_on_a_poisson_process():
    reqs = _session_requests()  # 20 sessions of 4 turns, 10 single requests: 30 sessions
    out = with_session_arrivals(reqs, rate=3.0, seed=5, turn_gap_s=0.5)
    assert sorted(r.request_id for r in out) == sorted(r.request_id for r in reqs)
    check_requests(out)  # sorted, unique, sessions in strict turn order
    starts = sorted(turns[0].arrival_s for turns in by_session(out).values())
    singles = sorted(r.arrival_s for r in out if r.session_id is None)
    # Session starts are the Poisson process at rate * sessions / requests = 3 * 30 / 90.
    assert sorted(starts + singles) == poisson_arrivals(30, 1.0, seed=5)
    for sid, turns in by_session(out).items():
        assert [r.turn for r in turns] == [0, 1, 2, 3], sid
        assert [b.arrival_s - turns[0].arrival_s for b in turns] == pytest.approx(
            [0.0, 0.5, 1.0, 1.5])
    assert with_session_arrivals(reqs, 3.0, seed=5, turn_gap_s=0.5) == out
    assert with_session_arrivals(reqs, 3.0, seed=6, turn_gap_s=0.5) != out
    with pytest.raises(ValueError, match="turn 0 twice"):
        with_session_arrivals([Request(f"r{i}", 0.0, 2, 1, token_ids=(1, 2), session_id="s",
                                       turn=0) for i in range(2)], 1.0)
    with pytest.raises(ValueError):
        with_session_arrivals(reqs, 0.0)
    with pytest.raises(ValueError):
        with_session_arrivals(reqs, 1.0, turn_gap_s=0.0)


def test_retime_and_scale_rate():
    reqs = with_poisson_arrivals(_session_requests(), rate=2.0, seed=1)
    fast = retime(reqs, 4.0)
    assert [r.request_id for r in fast] == [r.request_id for r in reqs]
    assert all(math.isclose(f.arrival_s, r.arrival_s / 4.0) for f, r in zip(fast, reqs))
    scaled = scale_rate(reqs, 10.0)
    assert math.isclose(mean_rate(scaled), 10.0, rel_tol=1e-9)
    check_requests(scaled)
    with pytest.raises(ValueError):
        retime(reqs, -1.0)


def test_check_requests_and_request_list():
    a = Request("a", 1.0, 2, 1, token_ids=(1, 2))
    b = Request("b", 0.5, 2, 1, token_ids=(1, 2))
    with pytest.raises(ValueError, match="not sorted"):
        RequestList("x", (a, b))
    with pytest.raises(ValueError, match="duplicate"):
        check_requests([b, b])
    late = Request("c", 2.0, 2, 1, token_ids=(1, 2), session_id="s", turn=1)
    early = Request("d", 3.0, 2, 1, token_ids=(1, 2), session_id="s", turn=0)
    with pytest.raises(ValueError, match="session 's'"):
        check_requests([late, early])
    w = RequestList("x", [b, a])
    assert [r.request_id for r in w.requests()] == ["b", "a"] and len(w) == 2


# ---------------------------------------------------------------- ShareGPT

def _conv(i, *msgs):
    return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in msgs]}


CONVS = [
    _conv(0, ("human", "hello there"), ("gpt", "hi how can I help"),
          ("human", "tell me a joke"), ("gpt", "no")),
    _conv(1, ("gpt", "continued from before"), ("human", "what is two plus two"),
          ("gpt", "four")),
    _conv(2, ("system", "be brief"), ("human", "name a colour"), ("gpt", "blue sky"),
          ("human", "unanswered question")),
    _conv(3, ("human", "only a question")),
]


def test_json_array_stream_stops_at_truncated_tail(tmp_path):
    full = json.dumps(CONVS, indent=2)
    cut = full[: full.index('"c3"') + 10]  # the last element is cut off
    path = tmp_path / "cut.json"
    path.write_text(cut, encoding="utf-8")
    for chunk in (7, 64, 1 << 20):  # chunk boundaries inside strings and numbers
        stream = JsonArrayStream(path, chunk_chars=chunk)
        assert list(stream) == CONVS[:3]
        assert stream.truncated
    complete = tmp_path / "full.json"
    complete.write_text(full, encoding="utf-8")
    stream = JsonArrayStream(complete, chunk_chars=5)
    assert list(stream) == CONVS and not stream.truncated


@pytest.mark.parametrize("text, message", [
    ('[{"a": 1} {"b": 2}]', "expected ',' or ']'"),
    ('[{"a": 1}, {"b": tru, "c": "padding padding padding padding"}]', "malformed JSON"),
    ('{"a": 1}', "expected a JSON array"),
])
def test_json_array_stream_rejects_malformed(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        list(JsonArrayStream(path))
    assert "bad.json" in str(info.value)


def test_sharegpt_sessions_extend_their_history(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(CONVS)[:-40], encoding="utf-8")  # truncated file
    w = load_sharegpt(path, n=4, seed=0, tokenizer="whitespace", system_prompt_tokens=50,
                      rate=3.0)
    reqs = list(w.requests())
    assert w.name == "sharegpt" and len(reqs) == 4
    assert {r.request_id for r in reqs} == {"sharegpt-0-t0", "sharegpt-0-t1",
                                            "sharegpt-1-t0", "sharegpt-2-t0"}
    check_requests(reqs)
    system = reqs[0].token_ids[:52]  # header + 50 filler tokens + end marker
    assert all(r.token_ids[:52] == system for r in reqs)
    got = {r.request_id: r for r in reqs}
    t0, t1 = got["sharegpt-0-t0"], got["sharegpt-0-t1"]
    assert t1.token_ids[: t0.input_length] == t0.token_ids
    reply = WS.encode("hi how can I help")
    assert t0.output_length == len(reply) == 5
    assert t1.token_ids[t0.input_length: t0.input_length + 5] == tuple(reply)
    assert got["sharegpt-1-t0"].output_length == 1  # "four"; the leading reply dropped
    # header + question + end + reply header; the unanswered question is not a request
    assert got["sharegpt-2-t0"].input_length == 52 + 1 + words("name a colour") + 1 + 1
    assert load_sharegpt(path, n=4, seed=0, tokenizer="whitespace",
                         system_prompt_tokens=50, rate=3.0) == w
    with pytest.raises(ValueError, match="only 4 requests"):
        load_sharegpt(path, n=5, tokenizer="whitespace", system_prompt_tokens=50)


def test_sharegpt_limits_and_bad_roles(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(CONVS), encoding="utf-8")
    w = load_sharegpt(path, n=3, tokenizer="whitespace", system_prompt_tokens=10,
                      max_input_len=20, max_output_len=2)
    assert all(r.input_length <= 20 and r.output_length <= 2 for r in w.requests())
    # conversation 0 ends before its second turn (prompt over 20 tokens)
    assert {r.request_id for r in w.requests()} == {"sharegpt-0-t0", "sharegpt-1-t0",
                                                    "sharegpt-2-t0"}
    assert {r.output_length for r in w.requests()} == {1, 2}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([_conv(0, ("robot", "beep"))]), encoding="utf-8")
    with pytest.raises(ValueError, match="element 0.*unknown role"):
        load_sharegpt(bad, n=1, tokenizer="whitespace")


def test_sharegpt_packaged_file_smoke():
    path = sharegpt_path()
    assert path.is_file() and path.stat().st_size > 1_000_000
    w = load_sharegpt(n=12, seed=5, system_prompt_tokens=400, max_conversations=40)
    reqs = list(w.requests())
    assert len(reqs) == 12
    check_requests(reqs)
    prefix = reqs[0].token_ids[:400]
    assert all(r.token_ids[:400] == prefix for r in reqs)
    assert all(0 <= t < 49152 for r in reqs for t in r.token_ids)
    assert all(r.input_length > 400 and r.output_length >= 1 for r in reqs)
    for turns in by_session(reqs).values():
        for a, b in zip(turns, turns[1:]):
            assert b.token_ids[: a.input_length] == a.token_ids


# ---------------------------------------------------------------- LooGLE

def test_loogle_reads_literal_qa_pairs():
    docs = read_loogle(FIXTURES / "loogle_sample.jsonl")
    assert [d[0] for d in docs] == ["The Lighthouse Keepers of Skerry Point",
                                    "A Short History of the Municipal Orchard",
                                    "The River Ferry"]
    assert docs[0][2][1] == ("Who kept the light the longest?",
                             "Annie Ferrier, for thirty-four years.")
    assert docs[1][2][0] == ("What was on the land before the orchard?", "A brickworks.")
    assert docs[2][2] == [("Summarize the text above.",
                           "A ferry linked the villages from 1820 to 1964, when a bridge "
                           "replaced it.")]


def test_loogle_fixture_requests():
    w = load_loogle(FIXTURES / "loogle_sample.jsonl", tokenizer="whitespace", rate=2.0)
    reqs = {r.request_id: r for r in w.requests()}
    assert sorted(reqs) == ["loogle-0-q0", "loogle-0-q1", "loogle-0-q2", "loogle-1-q0",
                            "loogle-1-q1", "loogle-2-q0"]
    title, doc, _ = read_loogle(FIXTURES / "loogle_sample.jsonl")[0]
    header = f"Please answer the question based on the long text below.\nTitle: {title}\n"
    prefix = words(header) + words(doc)
    r = reqs["loogle-0-q0"]
    assert r.input_length == prefix + words("\nQuestion: When was the lighthouse first lit?"
                                            "\nAnswer:")
    assert r.output_length == 2  # "In 1871."
    assert reqs["loogle-0-q1"].output_length == 5
    assert reqs["loogle-2-q0"].output_length == 14
    for q in ("loogle-0-q1", "loogle-0-q2"):
        assert common_prefix(reqs[q].token_ids, r.token_ids) >= prefix
    assert common_prefix(reqs["loogle-1-q0"].token_ids, r.token_ids) < prefix
    assert all(x.session_id is None for x in reqs.values())
    assert len(load_loogle(FIXTURES / "loogle_sample.jsonl", n=4, tokenizer="whitespace")) == 4


@pytest.mark.parametrize("qa, message", [
    ("__import__('os').system('echo pwned')", "not a Python literal"),
    ("[{'Q': 'q only'}]", r"qa_pairs\[0\] needs a string 'A'"),
    ("[]", "non-empty list"),
])
def test_loogle_rejects_bad_qa_pairs(tmp_path, qa, message):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"input": "doc", "title": "t", "qa_pairs": "[{'Q': 'a', 'A': 'b'}]"})
    path.write_text(good + "\n" + json.dumps({"input": "doc", "title": "t", "qa_pairs": qa})
                    + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        read_loogle(path)
    assert "bad.jsonl:2" in str(info.value)


def test_loogle_rejects_bad_json_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input": "doc", "title": "t", "qa_pairs": "none", "output": "s"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        read_loogle(path)


def test_synthetic_loogle_statistics_and_determinism():
    w = synthetic_loogle(120, seed=11)
    reqs = list(w.requests())
    assert len(reqs) == 120 and w.name == "loogle-synthetic"
    check_requests(reqs)
    docs: dict[str, list[Request]] = defaultdict(list)
    for r in reqs:
        docs[r.request_id.rsplit("-q", 1)[0]].append(r)
    counts = [len(v) for k, v in sorted(docs.items(), key=lambda kv: int(kv[0].split("-")[-1]))]
    assert all(6 <= c <= 25 for c in counts[:-1]) and 1 <= counts[-1] <= 25
    assert len(counts) >= 5
    for group in docs.values():
        lcp = min(common_prefix(group[0].token_ids, r.token_ids) for r in group[1:]) \
            if len(group) > 1 else group[0].input_length - 60
        assert 18000 <= lcp <= 30000 + 60
        for r in group:
            assert 20 <= r.input_length - lcp <= 60 or len(group) == 1
            assert 10 <= r.output_length <= 80
    mean_doc = statistics.fmean(g[0].input_length for g in docs.values())
    assert 20000 < mean_doc < 28000
    firsts = [g[0].token_ids for g in docs.values()]
    assert max(common_prefix(a, b) for a in firsts for b in firsts if a is not b) < 5
    assert all(17 <= t < 49152 for r in reqs[:5] for t in r.token_ids)
    assert synthetic_loogle(120, seed=11) == w
    assert synthetic_loogle(120, seed=12) != w


# ---------------------------------------------------------------- SCBench

def test_scbench_multi_turn_fixture():
    w = load_scbench(FIXTURES / "scbench_sample.jsonl", tokenizer="whitespace")
    reqs = list(w.requests())
    assert len(reqs) == 5
    check_requests(reqs)
    sessions = by_session(reqs)
    assert sorted(sessions) == ["scbench-0", "scbench-1"]
    s0 = sessions["scbench-0"]
    assert [r.request_id for r in s0] == ["scbench-0-t0", "scbench-0-t1", "scbench-0-t2"]
    assert [r.output_length for r in s0] == [2, 1, 7]
    assert [r.output_length for r in sessions["scbench-1"]] == [2, 1]  # "3\nthree", "delta"
    context = json.loads((FIXTURES / "scbench_sample.jsonl").read_text().splitlines()[0])
    ctx = words(context["context"])
    # user header + input + end + assistant header
    assert s0[0].input_length == ctx + 1 + words("Which aisle holds the hinges?") + 1 + 1
    for a, b in zip(s0, s0[1:]):
        assert b.token_ids[: a.input_length] == a.token_ids  # each prompt extends the last
        # + answer + end marker + next framed input
        assert b.input_length > a.input_length + a.output_length + 1


def test_scbench_shared_context_fixture():
    w = load_scbench(FIXTURES / "scbench_sample.jsonl", mode="shared-context",
                     tokenizer="whitespace")
    reqs = {r.request_id: r for r in w.requests()}
    assert sorted(reqs) == ["scbench-0-q0", "scbench-0-q1", "scbench-0-q2",
                            "scbench-1-q0", "scbench-1-q1"]
    assert all(r.session_id is None for r in reqs.values())
    context = json.loads((FIXTURES / "scbench_sample.jsonl").read_text().splitlines()[0])
    ctx = words(context["context"])
    q0, q1, q2 = (reqs[f"scbench-0-q{k}"] for k in range(3))
    assert q0.token_ids[:ctx] == q1.token_ids[:ctx] == q2.token_ids[:ctx]
    assert q1.token_ids[: q0.input_length] != q0.token_ids  # not a history extension
    assert q2.input_length == ctx + 3 + words("On which days do deliveries arrive, "
                                              "and through which gate?")
    with pytest.raises(ValueError, match="unknown SCBench mode"):
        load_scbench(FIXTURES / "scbench_sample.jsonl", mode="both", tokenizer="whitespace")


@pytest.mark.parametrize("line, message", [
    ('{"id": 0, "context": "c"}', "multi_turns"),
    ('{"id": 0, "context": "c", "multi_turns": [{"input": "q"}]}', "answer"),
    ('{"id": 0, "context": "", "multi_turns": [{"input": "q", "answer": "a"}]}', "context"),
])
def test_scbench_rejects_malformed(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        load_scbench(path, tokenizer="whitespace")
    assert "bad.jsonl:1" in str(info.value)


def test_synthetic_scbench_statistics_and_determinism():
    w = synthetic_scbench(40, seed=2, context_tokens=4000)
    reqs = list(w.requests())
    assert len(reqs) == 40
    check_requests(reqs)
    sessions = by_session(reqs)
    sizes = [len(v) for v in sessions.values()]
    assert all(2 <= s <= 5 for s in sizes[:-1]) or all(2 <= s <= 5 for s in sizes[1:])
    assert all(1 <= s <= 5 for s in sizes)
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert 3600 <= turns[0].input_length - 128 <= 4400
        for a, b in zip(turns, turns[1:]):
            assert b.token_ids[: a.input_length] == a.token_ids
            grow = b.input_length - a.input_length - a.output_length
            assert 16 <= grow <= 128 and 8 <= a.output_length <= 64
    shared = synthetic_scbench(40, seed=2, context_tokens=4000, mode="shared-context")
    assert all(r.session_id is None for r in shared.requests())
    by_ctx = defaultdict(list)
    for r in shared.requests():
        by_ctx[r.request_id.rsplit("-q", 1)[0]].append(r)
    for group in by_ctx.values():
        ctx = group[0].input_length - 128
        assert all(r.token_ids[:ctx] == group[0].token_ids[:ctx] for r in group)
    assert synthetic_scbench(40, seed=2, context_tokens=4000) == w
    assert synthetic_scbench(40, seed=3, context_tokens=4000) != w
    big = synthetic_scbench(2, seed=0)  # the default context is about 64K tokens
    assert 58000 <= next(big.requests()).input_length <= 72200


# ---------------------------------------------------------------- Mooncake

def test_mooncake_fixture():
    w = load_mooncake(FIXTURES / "mooncake_sample.jsonl")
    reqs = list(w.requests())
    assert len(reqs) == 10 and w.name == "mooncake"
    assert reqs[0] == Request("mooncake-0", 0.0, 1200, 10, block_hashes=(0, 1, 2))
    assert reqs[1].arrival_s == 0.15 and reqs[1].block_hashes == (0, 1)
    assert [r.output_length for r in reqs] == [10, 5, 20, 8, 1, 40, 3, 12, 7, 2]
    assert reqs[8].input_length == 513 and reqs[8].block_hashes == (6, 10)
    assert reqs[0].tokens()[:512] == reqs[1].tokens()[:512]
    assert prefix_reuse(reqs) == (6144, 11175)
    fast = load_mooncake(FIXTURES / "mooncake_sample.jsonl", speedup=2.0, n=3)
    assert [r.arrival_s for r in fast.requests()] == [0.0, 0.075, 0.15]


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1]}',
     "1 hash_ids for 600 input tokens"),
    ('{"timestamp": 5, "input_length": 10, "output_length": 0, "hash_ids": [1]}', ">= 1"),
    ('{"timestamp": 5, "input_length": 10, "hash_ids": [1]}', "missing"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 2, "hash_ids": [1]}',
     "timestamp"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}',
     "before the previous"),
    ('[1, 2]', "expected a JSON object"),
])
def test_mooncake_rejects_malformed(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    first = '{"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [0]}'
    path.write_text(first + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        load_mooncake(path)
    assert "trace.jsonl:2" in str(info.value)


def test_repeat_trace_reuse():
    reqs = list(load_mooncake(FIXTURES / "mooncake_sample.jsonl").requests())
    remapped = repeat_trace(reqs, 3)
    assert len(remapped) == 30
    check_requests(remapped)
    assert remapped[10].request_id == "mooncake-0-r1"
    assert remapped[10].block_hashes == (14, 15, 16)  # offset by max id + 1
    assert math.isclose(remapped[10].arrival_s, 2.5 + 2.5 / 9)
    assert prefix_reuse(remapped) == (3 * 6144, 3 * 11175)
    kept = repeat_trace(reqs, 3, remap_blocks=False)
    assert prefix_reuse(kept) == (6144 + 2 * 11175, 3 * 11175)
    assert len(repeat_trace(reqs, 3, n=25)) == 25
    tokens = [Request("t", 0.0, 3, 1, token_ids=(1, 2, 3))]
    with pytest.raises(ValueError, match="remap_blocks"):
        repeat_trace(tokens, 2)
    assert len(repeat_trace(tokens, 2, remap_blocks=False)) == 2


@pytest.mark.skipif(not MOONCAKE_TRACE.is_file(), reason="shared Mooncake trace not present")
def test_mooncake_real_trace():
    reqs = list(load_mooncake(MOONCAKE_TRACE).requests())
    assert len(reqs) == 3993
    assert abs(statistics.fmean(r.input_length for r in reqs) - 15325) < 50
    assert 16 * 60 < reqs[-1].arrival_s < 18 * 60
    # reusable prefix tokens with an unbounded cache, counted directly
    seen: set[int] = set()
    hit = total = 0
    for r in reqs:
        leading = 0
        while leading < len(r.block_hashes) and r.block_hashes[leading] in seen:
            leading += 1
        hit += min(leading * 512, r.input_length)
        total += r.input_length
        seen.update(r.block_hashes)
    fraction = hit / total
    print(f"Mooncake synthetic trace: {fraction:.1%} of input tokens are reusable prefix hits")
    assert 0.60 < fraction < 0.70
    assert prefix_reuse(reqs) == (hit, total)
    longer = repeat_trace(reqs, 4, n=12000)
    assert len(longer) == 12000
    h, t = prefix_reuse(longer)
    assert abs(h / t - fraction) < 0.02


# ---------------------------------------------------------------- registry

def test_load_workload_registry():
    w = load_workload("mooncake", path=FIXTURES / "mooncake_sample.jsonl")
    assert w.name == "mooncake" and len(w) == 10
    w = load_workload("scbench-synthetic", n=5, context_tokens=100, mode="shared-context")
    assert w.name == "scbench-synthetic" and len(w) == 5
    w = load_workload("loogle-synthetic", n=7, doc_tokens=200)
    assert len(w) == 7
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        load_workload("nope")
    with pytest.raises(ValueError, match="no option"):
        load_workload("loogle-synthetic", colour="red")
    with pytest.raises(ValueError, match="needs path"):
        load_workload("loogle")

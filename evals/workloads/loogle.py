"""LooGLE: long documents (~24K tokens) each asked several questions.

LooGLE publishes jsonl files with one document per line::

    {"input": "<the document>", "title": "...", "qa_pairs": "[{'Q': ..., 'A': ...}, ...]",
     "output": "none"}

``qa_pairs`` is the text of a Python literal (a list of dicts with ``Q``, ``A`` and
optionally ``S`` (evidence) and ``type``); it is parsed with :func:`ast.literal_eval`,
never evaluated. In the summarisation files ``qa_pairs`` is ``"none"`` and ``output``
holds the summary: such a line gives one request asking for a summary.

Each question becomes one request: the document (with a short title header) is the
prefix every question of that document shares exactly, followed by the question; the
answer's token count is the output length. :func:`synthetic_loogle` draws random
tokens with LooGLE's published shape (documents of about 24K tokens, 6-25 questions
each, questions of 20-60 tokens, answers of tens of tokens).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np

from evals.workloads.arrivals import with_poisson_arrivals
from evals.workloads.base import Request, RequestList, jsonl_objects
from evals.workloads.text import resolve_tokenizer

SUMMARY_QUESTION = "Summarize the text above."


def _doc_header(title: str) -> str:
    return f"Please answer the question based on the long text below.\nTitle: {title}\n"


def _question_text(question: str) -> str:
    return f"\nQuestion: {question}\nAnswer:"


def _parse_qa_pairs(raw: Any, output: Any, where: str) -> list[tuple[str, str]]:
    """(question, answer) pairs of one LooGLE line."""
    if isinstance(raw, str) and raw.strip().lower() == "none":
        if not isinstance(output, str) or output.strip().lower() in ("", "none"):
            raise ValueError(f"{where}: qa_pairs is 'none' and there is no 'output'")
        return [(SUMMARY_QUESTION, output)]
    if isinstance(raw, str):
        try:
            raw = ast.literal_eval(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
            raise ValueError(f"{where}: qa_pairs is not a Python literal: {e}") from None
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError(f"{where}: qa_pairs must be a non-empty list")
    pairs = []
    for j, qa in enumerate(raw):
        if not isinstance(qa, dict) or not isinstance(qa.get("Q"), str):
            raise ValueError(f"{where}: qa_pairs[{j}] needs a string 'Q'")
        answer = qa.get("A")
        if isinstance(answer, (list, tuple)) and all(isinstance(a, str) for a in answer):
            answer = "\n".join(answer)
        if not isinstance(answer, str):
            raise ValueError(f"{where}: qa_pairs[{j}] needs a string 'A'")
        pairs.append((qa["Q"], answer))
    return pairs


def read_loogle(path: Path | str) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """The (title, document, [(question, answer), ...]) of every line of a LooGLE
    jsonl file; ValueError naming ``file:line`` on malformed input."""
    path = Path(path)
    docs = []
    for where, _lineno, obj in jsonl_objects(path):
        document, title = obj.get("input"), obj.get("title", "")
        if not isinstance(document, str) or not document.strip():
            raise ValueError(f"{where}: 'input' (the document) must be a non-empty string")
        if not isinstance(title, str):
            raise ValueError(f"{where}: 'title' must be a string")
        if "qa_pairs" not in obj:
            raise ValueError(f"{where}: missing 'qa_pairs'")
        docs.append((title, document, _parse_qa_pairs(obj["qa_pairs"], obj.get("output"),
                                                      where)))
    if not docs:
        raise ValueError(f"{path}: no documents")
    return docs


def load_loogle(path: Path | str, *, n: int | None = None, seed: int = 0,
                tokenizer: Any = None, max_doc_tokens: int | None = None,
                max_output_len: int = 1024, rate: float = 1.0) -> RequestList:
    """Requests of a LooGLE jsonl file: document prefix + question, Poisson arrivals.

    ``n`` keeps the first ``n`` questions in file order (None: all); ``max_doc_tokens``
    cuts each document's tokens (the prefix stays shared); answers are capped at
    ``max_output_len`` tokens (at least 1). ``seed`` drives the arrival process and
    the interleaving of documents.
    """
    path = Path(path)
    encode = resolve_tokenizer(tokenizer)
    requests: list[Request] = []
    for d, (title, document, pairs) in enumerate(read_loogle(path)):
        if n is not None and len(requests) >= n:
            break
        prefix = encode(_doc_header(title)) + encode(document)
        if max_doc_tokens is not None:
            prefix = prefix[:max_doc_tokens]
        for j, (question, answer) in enumerate(pairs):
            if n is not None and len(requests) >= n:
                break
            prompt = prefix + encode(_question_text(question))
            out = max(1, min(len(encode(answer)), max_output_len))
            requests.append(Request(f"loogle-{d}-q{j}", 0.0, len(prompt), out,
                                    token_ids=prompt))
    if n is not None and len(requests) < n:
        raise ValueError(f"{path}: only {len(requests)} questions, {n} asked")
    return RequestList("loogle", with_poisson_arrivals(requests, rate, seed))


def synthetic_loogle(n: int = 100, *, seed: int = 0, doc_tokens: int = 24000,
                     doc_spread: float = 0.25, questions: tuple[int, int] = (6, 25),
                     question_tokens: tuple[int, int] = (20, 60),
                     answer_tokens: tuple[int, int] = (10, 80), vocab_size: int = 49152,
                     rate: float = 1.0, zipf: float = 0.0) -> RequestList:
    """``n`` LooGLE-shaped requests of random tokens, deterministic under ``seed``.

    Documents have ``doc_tokens * (1 +- doc_spread)`` tokens (uniform), each gets a
    uniform number of questions in ``questions`` (inclusive; the last document may
    get fewer so the total is ``n``), questions and answers uniform lengths in the
    given inclusive ranges. Token ids are drawn from ``[17, vocab_size)`` (above
    SmolLM2's control tokens). The questions of one document share its tokens as an
    exact prefix; different documents share nothing.

    ``zipf`` > 0 skews document popularity instead: as many documents as the uniform
    counts would make on average (``n`` over the mean of ``questions``), and each
    question asks document ``d`` (0-based rank) with probability proportional to
    ``(d + 1) ** -zipf``; 0 (the default) keeps the uniform counts above.
    """
    for name, (lo, hi) in (("questions", questions), ("question_tokens", question_tokens),
                           ("answer_tokens", answer_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
    if n < 1 or doc_tokens < 1 or not 0 <= doc_spread < 1 or vocab_size <= 17:
        raise ValueError("need n >= 1, doc_tokens >= 1, 0 <= doc_spread < 1, vocab_size > 17")
    if not zipf >= 0:
        raise ValueError(f"zipf must be >= 0, got {zipf}")
    rng = np.random.default_rng(seed)
    lo_doc = max(1, round(doc_tokens * (1 - doc_spread)))
    hi_doc = max(lo_doc, round(doc_tokens * (1 + doc_spread)))
    if zipf > 0:
        requests = _zipf_questions(n, rng, zipf, (lo_doc, hi_doc), questions, question_tokens,
                                   answer_tokens, vocab_size)
        return RequestList("loogle-synthetic", with_poisson_arrivals(requests, rate, seed))
    requests: list[Request] = []
    d = 0
    while len(requests) < n:
        doc = tuple(rng.integers(17, vocab_size, int(rng.integers(lo_doc, hi_doc + 1))).tolist())
        for j in range(int(rng.integers(questions[0], questions[1] + 1))):
            if len(requests) >= n:
                break
            q_len = int(rng.integers(question_tokens[0], question_tokens[1] + 1))
            prompt = doc + tuple(rng.integers(17, vocab_size, q_len).tolist())
            out = int(rng.integers(answer_tokens[0], answer_tokens[1] + 1))
            requests.append(Request(f"loogle-syn-{d}-q{j}", 0.0, len(prompt), out,
                                    token_ids=prompt))
        d += 1
    return RequestList("loogle-synthetic", with_poisson_arrivals(requests, rate, seed))


def _zipf_questions(n: int, rng: np.random.Generator, zipf: float, doc_range: tuple[int, int],
                    questions: tuple[int, int], question_tokens: tuple[int, int],
                    answer_tokens: tuple[int, int], vocab_size: int) -> list[Request]:
    """:func:`synthetic_loogle`'s questions with Zipf document popularity."""
    n_docs = max(1, round(n / ((questions[0] + questions[1]) / 2)))
    weights = np.arange(1, n_docs + 1, dtype=np.float64) ** -zipf
    picks = rng.choice(n_docs, size=n, p=weights / weights.sum())
    docs: dict[int, tuple[int, ...]] = {}
    asked: dict[int, int] = {}
    out = []
    for d in picks.tolist():
        if d not in docs:
            docs[d] = tuple(rng.integers(17, vocab_size, int(rng.integers(doc_range[0], doc_range[1] + 1))).tolist())
        j = asked.get(d, 0)
        asked[d] = j + 1
        q_len = int(rng.integers(question_tokens[0], question_tokens[1] + 1))
        prompt = docs[d] + tuple(rng.integers(17, vocab_size, q_len).tolist())
        out.append(Request(f"loogle-syn-{d}-q{j}", 0.0, len(prompt),
                           int(rng.integers(answer_tokens[0], answer_tokens[1] + 1)), token_ids=prompt))
    return out

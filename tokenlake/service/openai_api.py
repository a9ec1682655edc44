"""The OpenAI API's request bodies (pydantic), its error bodies, and the incremental
detokenizer that turns streamed token ids into text deltas with ``stop`` strings.

Only what the service implements is accepted: ``n`` other than 1, ``logprobs``,
``echo``, ``best_of`` and tool calls are refused with a 400 naming the field rather than
silently ignored; fields the API defines but that do not change the output (``user``,
``frequency_penalty`` = 0, ...) are accepted and ignored. Strings must be Unicode text (a
lone surrogate such as ``"\\ud800"``, which JSON can spell, is refused) and numbers must
be numbers (``true`` is not the token id 1, nor a temperature).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

MAX_STOPS = 4  # as OpenAI's API
MAX_SALT_CHARS = 256  # tokenlake.core.segments.MAX_SALT_CHARS


def _unicode(v: str) -> str:
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"holds a lone surrogate at character {e.start}: not Unicode "
                             f"text") from None
    return v


def _not_bool(v):
    if isinstance(v, bool):
        raise ValueError("must be a number, not true or false")
    return v


Text = Annotated[str, AfterValidator(_unicode)]  # a string that UTF-8 can encode
Int = Annotated[int, BeforeValidator(_not_bool)]  # an integer; a JSON boolean is refused
Float = Annotated[float, BeforeValidator(_not_bool)]


def _prompt_kind(v) -> str:
    if isinstance(v, str):
        return "text"
    return "texts" if isinstance(v, list) and v and isinstance(v[0], str) else "token_ids"


# a prompt is validated as the one form it looks like, so that an error names that form
Prompt = Annotated[Annotated[Text, Tag("text")] | Annotated[list[Int], Tag("token_ids")]
                   | Annotated[list[Text], Tag("texts")], Discriminator(_prompt_kind)]


class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status``, ``type`` and ``code``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type, code, param)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields common to both endpoints."""

    model_config = ConfigDict(extra="ignore", strict=False)

    model: Text
    max_tokens: Int | None = Field(default=None, description="tokens to generate at most")
    # below tokenlake.generation.sampling.MIN_TEMPERATURE (1e-5): greedy, as 0
    temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int = 1
    ignore_eos: bool = False  # an extension (as vLLM's): generate exactly max_tokens
    logprobs: bool | int | None = None
    # an extension (as vLLM's): the tenant namespace of the prompt's cached segments;
    # only requests with the same salt share them (docs/design.md §4)
    cache_salt: Text | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("max_tokens must be >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or ())
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise ValueError("only n = 1 is supported")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self

    @property
    def stops(self) -> list[str]:
        return list(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text or a list of token ids."""

    prompt: Prompt
    echo: bool = False
    max_tokens: Int | None = 16  # the API's default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (a list of strings must hold one)")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _no_echo(self):
        if self.echo:
            raise ValueError("echo is not supported")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: Text


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None

    @model_validator(mode="after")
    def _limit(self):
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise ValueError("max_completion_tokens must be >= 1")
            self.max_tokens = self.max_completion_tokens
        return self


class StopMatcher:
    """Where the first of a few stop strings occurs in a text fed piece by piece.

    One Knuth-Morris-Pratt automaton per stop: feeding ``n`` characters takes ``O(n)``
    steps per stop (amortized), whatever the stops' lengths and the text before, and
    :attr:`held` -- the longest end of the text that begins a stop, which must not be
    sent yet -- is the automata's state, not a scan.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = tuple(stops)
        self._fail = [_prefix_function(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # per stop: its longest prefix ending the text
        self.fed = 0  # characters fed so far

    def feed(self, piece: str) -> int | None:
        """Feeds ``piece``; returns the start (a character offset into the whole text) of
        the earliest-starting stop that ends in it, or None."""
        first = None
        for k, stop in enumerate(self.stops):
            q, fail, m = self._state[k], self._fail[k], len(stop)
            for i, c in enumerate(piece):
                while q and stop[q] != c:
                    q = fail[q - 1]
                if stop[q] == c:
                    q += 1
                if q == m:
                    start = self.fed + i + 1 - m
                    first = start if first is None else min(first, start)
                    q = fail[q - 1]
                    break  # this stop's first end in the piece is its earliest start
            self._state[k] = q
        self.fed += len(piece)
        return first

    @property
    def held(self) -> int:
        """Characters at the end of the text that begin some stop (0: none)."""
        return max(self._state, default=0)


def _prefix_function(s: str) -> list[int]:
    """``p[i]``: the length of the longest proper prefix of ``s[:i + 1]`` that is also
    its suffix (KMP's failure function)."""
    p = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = p[k - 1]
        if s[i] == s[k]:
            k += 1
        p[i] = k
    return p


class Detokenizer:
    """Text deltas of a growing list of token ids, cut at the first ``stop`` string.

    A delta never ends inside a multi-byte character (the replacement character of a
    partial one is held back until its bytes arrive) nor with text that could begin a
    stop string, so the client never receives text that a later token turns into a stop.

    The work per token is bounded, so a whole answer costs time linear in its length:
    each token decodes only the ids since the last character boundary, with the piece
    before it as context (as vLLM's incremental detokenizer: a decoder may treat a
    sequence's first token differently), and the stops are matched by
    :class:`StopMatcher` on the new characters only. ``decode(ids)`` must be the text
    of ``ids``, ending in U+FFFD while a character is incomplete; the deltas and
    :meth:`flush` add up to ``decode(all ids)`` cut at the first stop.
    """

    #: most ids a window may hold past the last boundary before its text goes out as it
    #: is (a bound on the work per token; 4 bytes make any character)
    MAX_PENDING = 32

    def __init__(self, decode, stops: list[str]) -> None:
        self.decode, self.stops = decode, list(stops)
        self._matcher = StopMatcher(self.stops) if self.stops else None
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read]: the last piece decoded whole (context)
        self._read = 0  # ids before it are decoded into the text
        self._ahead = 0  # characters of decode(ids[_prefix:]) past the context, taken already
        self._sent: list[str] = []  # the deltas handed out
        self._held = ""  # text decoded but not handed out (it may begin a stop)
        self.sent = 0  # characters handed out
        self.stopped = False  # a stop string ended the text: add nothing more

    @property
    def text(self) -> str:
        """The text so far (cut at the stop once :attr:`stopped`)."""
        return "".join(self._sent) + self._held

    def add(self, token_id: int) -> str:
        """The new text ``token_id`` makes safe to send ('' if none)."""
        self.ids.append(token_id)
        return self._extend(self._decode_new(final=False))

    def flush(self) -> str:
        """What is still held back, once generation ended without a stop string (a
        stop that the last, incomplete character completes still cuts it)."""
        delta = self._extend(self._decode_new(final=True))
        return delta if self.stopped else delta + self._release(self.sent + len(self._held))

    def _decode_new(self, final: bool) -> str:
        """The characters the ids since the last boundary add; an incomplete last
        character stays out unless ``final``."""
        context = self.decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        new = self.decode(self.ids[self._prefix:])
        end, start = len(new), len(context) + self._ahead
        # a character takes at most 4 byte tokens: a window longer than MAX_PENDING still
        # ending in U+FFFD ends in bytes that are no character (or in control tokens)
        if not final and len(self.ids) - self._read <= self.MAX_PENDING:
            while end > start and new[end - 1] == "\ufffd":
                end -= 1
        piece = new[start:end] if end > start else ""
        if end == len(new):  # a character boundary: the next window starts here
            self._prefix, self._read, self._ahead = self._read, len(self.ids), 0
        else:
            self._ahead += len(piece)
        return piece

    def _extend(self, piece: str) -> str:
        if self.stopped or not piece:
            return ""
        self._held += piece
        total = self.sent + len(self._held)
        if self._matcher is None:
            return self._release(total)
        cut = self._matcher.feed(piece)
        if cut is not None:
            self.stopped = True
            delta = self._release(cut)
            self._held = ""  # the stop and what follows it are never sent
            return delta
        return self._release(total - self._matcher.held)

    def _release(self, upto: int) -> str:
        """Hands out the held text up to character ``upto`` of the whole text."""
        n = upto - self.sent
        if n <= 0:
            return ""
        delta, self._held = self._held[:n], self._held[n:]
        self.sent = upto
        self._sent.append(delta)
        return delta

"""The OpenAI API's request bodies (pydantic), its error bodies, and the incremental
detokenizer that turns streamed token ids into text deltas with ``stop`` strings.

Only what the service implements is accepted: ``n`` other than 1, ``logprobs``,
``echo``, ``best_of`` and tool calls are refused with a 400 naming the field rather than
silently ignored; fields the API defines but that do not change the output (``user``,
``frequency_penalty`` = 0, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 4  # as OpenAI's API


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

    model: str
    max_tokens: int | None = Field(default=None, description="tokens to generate at most")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # an extension (as vLLM's): generate exactly max_tokens
    logprobs: bool | int | None = None

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

    prompt: str | list[int] | list[str]
    echo: bool = False
    max_tokens: int | None = 16  # the API's default for completions

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
    content: str


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    @model_validator(mode="after")
    def _limit(self):
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise ValueError("max_completion_tokens must be >= 1")
            self.max_tokens = self.max_completion_tokens
        return self


class Detokenizer:
    """Text deltas of a growing list of token ids, cut at the first ``stop`` string.

    A delta never ends inside a multi-byte character (the replacement character of a
    partial one is held back) nor with text that could begin a stop string, so the
    client never receives text that a later token turns into a stop.
    """

    def __init__(self, decode, stops: list[str]) -> None:
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the text handed out
        self.text = ""
        self.stopped = False  # a stop string ended the text: add nothing more

    def add(self, token_id: int) -> str:
        """The new text ``token_id`` makes safe to send ('' if none)."""
        self.ids.append(token_id)
        text = self.decode(self.ids)
        hits = [i for stop in self.stops if (i := text.find(stop, self.sent)) >= 0]
        if hits:
            self.text, self.stopped = text[: min(hits)], True
            return self._take(len(self.text))
        self.text = text
        hold = max((k for s in self.stops for k in range(len(s) - 1, 0, -1)
                    if text.endswith(s[:k])), default=0)
        safe = len(text) - hold
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        return self._take(safe)

    def flush(self) -> str:
        """What is still held back, once generation ended without a stop string."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        delta = self.text[self.sent: upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return delta

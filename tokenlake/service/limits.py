"""What the HTTP front door refuses before any heavy work, and the middleware that reads
request bodies under those limits.

:class:`HttpLimits` holds the limits (``tokenlake serve``'s ``http_*`` settings).
:class:`BodyGuard` is a pure ASGI middleware in front of the app: it reads a request's
whole body itself before the app sees it, so that

* a ``Content-Length`` over ``max_body_bytes`` is answered 413 at once, without reading a
  byte of the body, and a body that turns out longer (chunked, or lying) is cut off at
  the limit with the same 413;
* a body that does not arrive in full within ``body_timeout_s`` (a client that sends less
  than its ``Content-Length`` says, or dribbles) is answered 408;
* a body that is not UTF-8 is answered 400 (the API speaks JSON);
* every refusal is an OpenAI-style error body, and closes the connection (the rest of an
  unread body is never read).

Reading happens on the event loop without blocking it: other requests, ``/health``
included, are served meanwhile. The app then gets the body as one message, and later
``receive()`` calls go to the server (a handler waiting for ``http.disconnect`` hears it).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


@dataclass(frozen=True)
class HttpLimits:
    """Limits of the HTTP front door (each checked before the work it bounds).

    Attributes:
        max_body_bytes: largest request body, bytes (413 above; the ``Content-Length``
            is checked before reading).
        body_timeout_s: seconds a request's body may take to arrive in full, from the
            end of its headers (408 after).
        max_prompt_tokens: most prompt tokens (None: the model's context). A text prompt
            longer than ``max_prompt_tokens`` x the longest token's UTF-8 bytes, in
            characters, cannot fit and is refused before it is tokenized; the exact count
            is checked after.
        max_stop_chars: most characters of one stop string (at most 4 strings, as
            OpenAI's API).
    """

    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 10.0
    max_prompt_tokens: int | None = None
    max_stop_chars: int = 1000

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_stop_chars < 1 or not self.body_timeout_s > 0:
            raise ValueError(f"HttpLimits must be positive: {self}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


@functools.lru_cache(maxsize=8)
def longest_token_bytes(tokenizer, vocab_size: int) -> int:
    """The most UTF-8 bytes any one token decodes to (control tokens included, a lone
    byte counted as its 3-byte replacement character): no text of ``c`` characters is
    fewer than ``c / longest`` tokens. 81 for SmolLM2-135M; about 50 ms to compute."""
    return max(len(tokenizer.decode([i]).encode("utf-8", "replace")) for i in range(vocab_size))


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class _ClientGone(Exception):
    pass


class BodyGuard:
    """ASGI middleware reading request bodies under :class:`HttpLimits` (see the module).

    Args:
        app: the ASGI app behind it.
        limits: the limits.
        refused: called with the status of every refusal (metrics, logs).
        in_flight: called with +1 when a ``POST`` reaches the app and -1 when the app
            has answered it (for a stream: when the stream ended).
    """

    def __init__(self, app, limits: HttpLimits, refused: Callable[[int], None] = lambda s: None,
                 in_flight: Callable[[int], None] = lambda d: None) -> None:
        self.app, self.limits, self.refused, self.in_flight = app, limits, refused, in_flight

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in _METHODS_WITH_BODY:
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
        except _Refused as r:
            log.warning("%s %s -> %d: %s", scope["method"], scope["path"], r.status, r.message)
            self.refused(r.status)
            await _send_error(send, r.status, r.message, r.code)
            return
        except _ClientGone:
            return
        first = True

        async def replay() -> dict:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        self.in_flight(1)
        try:
            await self.app(scope, replay, send)
        finally:
            self.in_flight(-1)

    async def _read(self, scope, receive: Callable[[], Awaitable[dict]]) -> bytes:
        limit = self.limits.max_body_bytes
        length = _content_length(scope)
        if length is not None and length > limit:
            raise _Refused(413, f"the request body is {length} bytes; at most {limit} are "
                                f"accepted", "request_too_large")
        try:
            body = await asyncio.wait_for(_read_all(receive, limit), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise _Refused(408, f"the request body did not arrive in full within "
                                f"{self.limits.body_timeout_s:g} s", "request_timeout") from None
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Refused(400, f"the request body is not valid UTF-8 (byte {e.start})",
                           "invalid_encoding") from None
        return body


async def _read_all(receive, limit: int) -> bytes:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _Refused(413, f"the request body is over the limit of {limit} bytes",
                           "request_too_large")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise _Refused(400, "the Content-Length header is not a number",
                               "invalid_request") from None
    return None


async def _send_error(send, status: int, message: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})

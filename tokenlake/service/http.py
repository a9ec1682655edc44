"""The OpenAI-compatible HTTP front end (FastAPI on uvicorn) of a served pool.

Routes: ``POST /v1/completions`` (``prompt``: text or token ids),
``POST /v1/chat/completions`` (the model's chat template), ``stream: true`` as
server-sent events, ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus). Requests go to an :class:`~tokenlake.service.generation_thread.GenerationThread`,
which batches every live request each iteration; a client that disconnects cancels its
request, whether it streams or not. Bad input is answered with an OpenAI-style error body
and a 4xx status, logged in one line, and touches nothing else.

The event loop does only bounded work per request, so ``/health`` answers within
milliseconds whatever one client sends: bodies are read under
:class:`~tokenlake.service.limits.HttpLimits` (size, time, UTF-8) by
:class:`~tokenlake.service.limits.BodyGuard`; a text prompt too long to fit the prompt
limit is refused before it is tokenized; prompts are tokenized on worker threads (the
tokenizer releases the GIL); detokenizing and stop matching cost bounded work per token
(linear in the output), and stop strings are bounded in length. A request that fails on its own (its sampling, its
detokenizing) gets a 500-class error (an error chunk when streaming); the requests
beside it go on unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tokenlake.generation.requests import BadRequest, GenerationRequest
from tokenlake.generation.sampling import SamplingError, SamplingParams
from tokenlake.service.generation_thread import (
    EngineFailed,
    GenerationThread,
    LoopClosed,
    RequestFailed,
    RequestStream,
    TokenEvent,
)
from tokenlake.service.limits import BodyGuard, HttpLimits, longest_token_bytes
from tokenlake.service.metrics import CONTENT_TYPE, ServiceMetrics
from tokenlake.service.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Detokenizer,
    _Sampling,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the front end serves: the model's name, tokenizer and limits.

    ``max_request_tokens``: prompt + output tokens one request may hold in the pool
    (None: only the context limit applies)."""

    name: str
    tokenizer: object  # ChatTokenizer: encode, decode, apply_chat_template, eos_id
    max_context: int
    vocab_size: int
    max_request_tokens: int | None = None


@dataclass
class _Job:
    """One admitted request on its way out: what the response needs."""

    kind: str  # "text_completion" or "chat.completion"
    id: str
    created: int
    body: _Sampling
    prompt_tokens: int
    stream: RequestStream
    detok: Executor | None  # where its detokenizer is built (None: asyncio's default threads)


def create_app(loop: GenerationThread, model: ModelInfo, metrics: ServiceMetrics,
               limits: HttpLimits | None = None, detok: Executor | None = None) -> FastAPI:
    """The ASGI app serving ``model`` through ``loop`` under ``limits`` (default:
    :class:`HttpLimits`'s defaults). Each request's detokenizer is built on ``detok``
    (the front end gives one thread; None: asyncio's default threads) and runs on the
    event loop (:func:`_texts` says why); prompts are tokenized on asyncio's default
    threads (the tokenizer releases the GIL), so a long prompt delays no stream."""
    limits = limits if limits is not None else HttpLimits()
    check_prompt = _prompt_check(model, limits)
    app = FastAPI(title="TokenLake", summary="OpenAI-compatible API of a TokenLake pool")
    app.state.model, app.state.limits = model, limits
    app.add_middleware(BodyGuard, limits=limits, refused=lambda status: metrics.rejected(),
                       in_flight=metrics.in_flight.inc)
    _add_error_handlers(app, metrics)
    _add_info_routes(app, model, metrics)
    _add_completion_routes(app, loop, model, limits, detok, check_prompt)
    return app


def _prompt_check(model: ModelInfo, limits: HttpLimits) -> Callable[[int, str], None]:
    """``check_prompt(size, unit)``: refuses (:class:`ApiError` 400) a prompt of ``size``
    characters (``unit="chars"``, before tokenizing) or tokens that cannot fit the
    prompt limit (``limits.max_prompt_tokens``, at most the model's context)."""
    max_prompt = min(limits.max_prompt_tokens or model.max_context, model.max_context)
    # no text of more characters than this can be max_prompt tokens or fewer
    max_chars = max_prompt * longest_token_bytes(model.tokenizer, model.vocab_size)

    def check_prompt(size: int, unit: str) -> None:
        """Refuses a prompt of ``size`` characters (``unit="chars"``, before
        tokenizing) or tokens that cannot fit ``max_prompt`` tokens."""
        if size > (max_chars if unit == "chars" else max_prompt):
            what = (f"{size} characters, more than {max_prompt} tokens can hold"
                    if unit == "chars" else f"{size} tokens")
            raise ApiError(400, f"the prompt is {what}; at most {max_prompt} prompt tokens "
                                f"are accepted", code="context_length_exceeded", param="prompt")

    return check_prompt


def _add_error_handlers(app: FastAPI, metrics: ServiceMetrics) -> None:
    """Every error as an OpenAI-style JSON body: :class:`ApiError` (logged in one line,
    a 4xx counted as rejected), a body that fails validation (400), an unknown path or
    method, and any bug (500, never a plain-text body)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        if exc.status < 500:
            metrics.rejected()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        loc = [x for x in (exc.errors()[:1] or [{}])[0].get("loc", ()) if x != "body"]
        param = loc[0] if loc and isinstance(loc[0], str) else None  # the field at fault
        return await api_error(request, ApiError(400, _validation_message(exc), param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # unknown path, method
        return await api_error(request, ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception):  # never a plain-text 500
        log.error("%s %s failed: %s: %s", request.method, request.url.path,
                  type(exc).__name__, exc)
        return JSONResponse(ApiError(500, f"internal error ({type(exc).__name__})",
                                     "server_error").body(), status_code=500)


def _add_info_routes(app: FastAPI, model: ModelInfo, metrics: ServiceMetrics) -> None:
    """``GET /health``, ``GET /v1/models`` and ``GET /metrics`` (Prometheus)."""

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model.name, "object": "model", "created": 0, "owned_by": "tokenlake",
            "max_model_len": model.max_context}]}

    @app.get("/metrics")
    async def scrape():
        return Response(metrics.render(), media_type=CONTENT_TYPE)


def _add_completion_routes(app: FastAPI, loop: GenerationThread, model: ModelInfo,
                           limits: HttpLimits, detok: Executor | None,
                           check_prompt: Callable[[int, str], None]) -> None:
    """``POST /v1/completions`` and ``POST /v1/chat/completions``: each body is checked,
    its prompt tokenized (off the event loop when long) and submitted to ``loop``; the
    answer streams as server-sent events or comes back whole."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_body(body, model, limits)
        prompt = body.prompt
        if isinstance(prompt, str):
            check_prompt(len(prompt), "chars")
            ids = await _off_loop(len(prompt), None, model.tokenizer.encode, prompt)
        else:
            ids = list(prompt)
        return await _serve("text_completion", "cmpl", body, ids, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        _check_body(body, model, limits)
        chars = sum(len(m.role) + len(m.content) for m in body.messages)
        check_prompt(chars, "chars")
        ids = await _off_loop(chars, None, model.tokenizer.apply_chat_template,
                              [m.model_dump() for m in body.messages])
        return await _serve("chat.completion", "chatcmpl", body, ids, request)

    async def _serve(kind: str, prefix: str, body: _Sampling, ids: list[int], request: Request):
        check_prompt(len(ids), "tokens")
        req = _generation_request(f"{prefix}-{uuid.uuid4().hex}", body, ids, model)
        try:
            stream = await loop.submit(req)
        except BadRequest as e:
            raise ApiError(400, str(e)) from None
        except LoopClosed as e:
            raise ApiError(503, str(e), "server_error", "unavailable") from None
        except EngineFailed as e:
            raise ApiError(500, str(e), "server_error") from None
        job = _Job(kind, req.request_id, int(time.time()), body, len(ids), stream, detok)
        if body.stream:
            return StreamingResponse(_sse(job, model), media_type="text/event-stream")
        return await _complete(job, model, request)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msg = str(err.get("msg")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request"


def _check_body(body: _Sampling, model: ModelInfo, limits: HttpLimits) -> None:
    """What can be refused before the prompt is tokenized: the model, the stop strings
    (:class:`ApiError` 404/400)."""
    if body.model != model.name:
        raise ApiError(404, f"model {body.model!r} is not served here (serving "
                            f"{model.name!r})", code="model_not_found", param="model")
    longest = max(map(len, body.stops), default=0)
    if longest > limits.max_stop_chars:
        raise ApiError(400, f"a stop sequence is {longest} characters; at most "
                            f"{limits.max_stop_chars} are accepted", param="stop")


def _generation_request(request_id: str, body: _Sampling, ids: list[int],
                        model: ModelInfo) -> GenerationRequest:
    """The request ``body`` asks for, or an :class:`ApiError` (400)."""
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    bad = [t for t in ids if not 0 <= t < model.vocab_size]
    if bad:
        raise ApiError(400, f"token ids outside [0, {model.vocab_size}): {bad[:5]}",
                       param="prompt")
    room = model.max_context - len(ids)
    max_new = body.max_tokens if body.max_tokens is not None else room
    if len(ids) + max_new > model.max_context:
        raise ApiError(400, f"{len(ids)} prompt tokens + {max_new} to generate exceed the "
                            f"context of {model.max_context} tokens",
                       code="context_length_exceeded", param="max_tokens")
    limit = model.max_request_tokens
    if limit is not None and len(ids) + max_new > limit:
        raise ApiError(400, f"{len(ids)} prompt tokens + {max_new} to generate exceed what "
                            f"the pool can hold for one request ({limit} tokens)",
                       code="context_length_exceeded", param="max_tokens")
    try:
        sampling = SamplingParams(body.temperature, body.top_p, body.seed)
    except SamplingError as e:
        raise ApiError(400, str(e)) from None
    stop_ids = () if body.ignore_eos else (model.tokenizer.eos_id,)
    return GenerationRequest(request_id, tuple(ids), max_new, stop_ids, sampling, body.cache_salt)


async def _texts(job: _Job, model: ModelInfo) -> AsyncIterator[tuple[str, str | None, int]]:
    """``(text delta, finish_reason or None, tokens so far)`` for every token as it
    arrives (the delta may be empty: text held back); a stop string ends the request at
    once (its leases go back before the next iteration). If detokenizing fails (a token
    the tokenizer does not know), the request ends and :class:`RequestFailed` is raised.

    The detokenizer is built on a worker thread (its stop tables take time linear in the
    stops' length), and runs here, on the event loop, once for all the tokens that
    arrived together: its work per token is bounded (a few ids decoded, the new
    characters fed to the stop automata), about what formatting the token's SSE chunk
    costs. Measured with 40 streams at 500 tokens/s each, ``/health`` p90 was 1.8 ms this
    way and 31-52 ms (max 110-123 ms) with a worker-thread hop per batch: the hops made
    the event loop wait for the GIL."""
    try:  # (the stops' tables are built on the thread too: linear, but in their length)
        detok = await _off_loop(sum(map(len, job.body.stops)), job.detok, Detokenizer,
                                lambda ids: model.tokenizer.decode(ids, skip_special_tokens=True),
                                job.body.stops)
        async for batch in job.stream.batches():
            parts = _detokenize(detok, batch)  # bounded work per token: here (see below)
            for ev, (delta, reason) in zip(batch, parts):
                if detok.stopped:
                    job.stream.close()
                yield delta, reason, ev.index + 1
                if reason is not None:
                    return
    except (EngineFailed, LoopClosed, RequestFailed):
        raise
    except Exception as e:  # this request's detokenizing or stop matching
        job.stream.close()
        log.warning("request %s failed: %s: %s", job.id, type(e).__name__, e)
        raise RequestFailed(f"the request failed: could not turn its tokens into text: "
                            f"{type(e).__name__}: {e}") from None


#: Work on more characters than this (a prompt to tokenize, stops to build tables for)
#: runs on a worker thread; less (about a millisecond or under) runs on the event loop,
#: where it costs less than the hop: 40 requests arriving together stalled the loop
#: about 150 ms when each hopped, the GIL passing between the threads.
OFF_LOOP_CHARS = 2048


async def _off_loop(chars: int, executor: Executor | None, fn, *args):
    """``fn(*args)``, on ``executor`` (None: asyncio's default threads) when it works on
    more than :data:`OFF_LOOP_CHARS` characters, else here."""
    if chars <= OFF_LOOP_CHARS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


def _detokenize(detok: Detokenizer, events: list[TokenEvent]) -> list[tuple[str, str | None]]:
    """``(delta, finish_reason or None)`` of each event, up to the one that ends the
    text (the last event, or a stop string)."""
    out = []
    for ev in events:
        delta = detok.add(ev.token_id)
        if ev.done and not detok.stopped:
            delta += detok.flush()
        out.append((delta, "stop" if detok.stopped else ev.finish_reason if ev.done else None))
        if out[-1][1] is not None:
            break
    return out


def _usage(job: _Job, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": job.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _complete(job: _Job, model: ModelInfo, request: Request) -> dict | Response:
    """The whole answer, as one JSON body. A client that hangs up meanwhile cancels the
    request (its leases go back before the next iteration) and ends this handler."""
    collect = asyncio.ensure_future(_collect(job, model))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect, gone):
            task.cancel()
        job.stream.close()  # a no-op once the request finished
    if not collect.done() or collect.cancelled():  # the client went first: nobody to answer
        log.info("%s: the client hung up; request cancelled", job.id)
        return Response(status_code=499)
    try:
        out, reason, n = collect.result()
    except (EngineFailed, LoopClosed, RequestFailed) as e:
        raise ApiError(500, str(e), "server_error") from None
    choice = ({"index": 0, "message": {"role": "assistant", "content": out},
               "finish_reason": reason} if job.kind == "chat.completion" else
              {"index": 0, "text": out, "logprobs": None, "finish_reason": reason})
    return {"id": job.id, "object": job.kind, "created": job.created, "model": job.body.model,
            "choices": [choice], "usage": _usage(job, n, job.stream.hit_tokens)}


async def _collect(job: _Job, model: ModelInfo) -> tuple[str, str | None, int]:
    text, reason, n = [], None, 0
    async for part in _texts(job, model):  # the last part holds the reason and count
        delta, reason, n = part
        text.append(delta)
    return "".join(text), reason, n


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the ASGI server reports it as a message)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(job: _Job, model: ModelInfo) -> AsyncIterator[str]:
    """The answer as server-sent events, one chunk per generated token (its text may be
    empty while held back; the last one carries ``finish_reason``), then the usage
    chunk if asked for, then ``data: [DONE]``."""
    chat = job.kind == "chat.completion"
    head = {"id": job.id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": job.created, "model": job.body.model}

    def event(delta: str | None, reason: str | None, role: bool = False) -> str:
        if chat:
            d = {"role": "assistant", "content": ""} if role else (
                {} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

    n = 0
    try:
        if chat:
            yield event(None, None, role=True)
        async for part in _texts(job, model):
            delta, reason, n = part
            yield event(delta, reason)
        if job.body.include_usage:
            usage = {**head, "choices": [], "usage": _usage(job, n, job.stream.hit_tokens)}
            yield f"data: {json.dumps(usage)}\n\n"
    except (EngineFailed, LoopClosed, RequestFailed) as e:  # the client hears why
        yield f"data: {json.dumps(ApiError(500, str(e), 'server_error').body())}\n\n"
    finally:
        job.stream.close()  # a client gone mid-stream: the request ends here
    yield "data: [DONE]\n\n"

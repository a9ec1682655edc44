"""The OpenAI-compatible HTTP front end (FastAPI on uvicorn) of a served pool.

Routes: ``POST /v1/completions`` (``prompt``: text or token ids),
``POST /v1/chat/completions`` (the model's chat template), ``stream: true`` as
server-sent events, ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus). Requests go to an :class:`~tokenlake.service.engine_loop.EngineLoop`,
which batches every live request each iteration; a client that disconnects cancels its
request. Bad input is answered with an OpenAI-style error body and a 4xx status, logged
in one line, and touches nothing else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tokenlake.service.engine_loop import EngineFailed, EngineLoop, LoopClosed, RequestStream
from tokenlake.service.metrics import CONTENT_TYPE, ServiceMetrics
from tokenlake.service.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Detokenizer,
    _Sampling,
)
from tokenlake.serving.sampling import SamplingError, SamplingParams
from tokenlake.serving.server import BadRequest, GenerationRequest

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


def create_app(loop: EngineLoop, model: ModelInfo, metrics: ServiceMetrics) -> FastAPI:
    """The ASGI app serving ``model`` through ``loop``."""
    app = FastAPI(title="TokenLake", summary="OpenAI-compatible API of a TokenLake pool")
    app.state.model = model

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        if exc.status < 500:
            metrics.rejected()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return await api_error(request, ApiError(400, _validation_message(exc)))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # unknown path, method
        return await api_error(request, ApiError(exc.status_code, str(exc.detail)))

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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return await _serve("text_completion", "cmpl", body, ids, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        ids = model.tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        return await _serve("chat.completion", "chatcmpl", body, ids, request)

    async def _serve(kind: str, prefix: str, body: _Sampling, ids: list[int], request: Request):
        req = _generation_request(f"{prefix}-{uuid.uuid4().hex}", body, ids, model)
        try:
            stream = await loop.submit(req)
        except BadRequest as e:
            raise ApiError(400, str(e)) from None
        except LoopClosed as e:
            raise ApiError(503, str(e), "server_error", "unavailable") from None
        except EngineFailed as e:
            raise ApiError(500, str(e), "server_error") from None
        job = _Job(kind, req.request_id, int(time.time()), body, len(ids), stream)
        if body.stream:
            return StreamingResponse(_sse(job, model), media_type="text/event-stream")
        return await _complete(job, model, request)

    return app


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def _generation_request(request_id: str, body: _Sampling, ids: list[int],
                        model: ModelInfo) -> GenerationRequest:
    """The request ``body`` asks for, or an :class:`ApiError` (400/404)."""
    if body.model != model.name:
        raise ApiError(404, f"model {body.model!r} is not served here (serving "
                            f"{model.name!r})", code="model_not_found", param="model")
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
    return GenerationRequest(request_id, tuple(ids), max_new, stop_ids, sampling)


async def _texts(job: _Job, model: ModelInfo) -> AsyncIterator[tuple[str, str | None, int]]:
    """``(text delta, finish_reason or None, tokens so far)`` for every token as it
    arrives (the delta may be empty: text held back); a stop string ends the request at
    once (its leases go back before the next iteration)."""
    detok = Detokenizer(lambda ids: model.tokenizer.decode(ids, skip_special_tokens=True),
                        job.body.stops)
    n = 0
    async for ev in job.stream:
        n = ev.index + 1
        delta = detok.add(ev.token_id)
        if detok.stopped:
            job.stream.close()
            yield delta, "stop", n
            return
        if ev.done:
            yield delta + detok.flush(), ev.finish_reason, n
            return
        yield delta, None, n


def _usage(job: _Job, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": job.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _complete(job: _Job, model: ModelInfo, request: Request) -> dict:
    """The whole answer, as one JSON body; a client gone meanwhile cancels it."""

    async def gone() -> None:  # the ASGI server reports a disconnect as a message
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.stream.close()

    watcher = asyncio.ensure_future(gone())
    text, reason, n = [], None, 0
    try:
        async for part in _texts(job, model):  # the last part holds the reason and count
            delta, reason, n = part
            text.append(delta)
    except (EngineFailed, LoopClosed) as e:
        raise ApiError(500, str(e), "server_error") from None
    finally:
        watcher.cancel()
    out = "".join(text)
    choice = ({"index": 0, "message": {"role": "assistant", "content": out},
               "finish_reason": reason} if job.kind == "chat.completion" else
              {"index": 0, "text": out, "logprobs": None, "finish_reason": reason})
    return {"id": job.id, "object": job.kind, "created": job.created, "model": job.body.model,
            "choices": [choice], "usage": _usage(job, n, job.stream.hit_tokens)}


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
    except (EngineFailed, LoopClosed) as e:
        yield f"data: {json.dumps(ApiError(500, str(e), 'server_error').body())}\n\n"
    finally:
        job.stream.close()  # a client gone mid-stream: the request ends here
    yield "data: [DONE]\n\n"

"""``tokenlake bench http``: what the HTTP layer adds to a request.

The same kind of request -- a fresh prompt of random token ids, so no request reuses
another's prefix, and a few generated tokens -- is sent alternately straight to the
serving loop (``GenerationThread.submit`` from this process, no HTTP) and as ``POST
/v1/completions`` with httpx (JSON, FastAPI's validation, uvicorn, detokenizing, and
the response back), one request at a time. The difference of the two medians is the
HTTP layer's cost per request; both ranges are reported.

Two backends: ``instant`` answers every request in one iteration with no model (the
HTTP layer's cost alone, which a model's run time would otherwise bury in its noise);
``pool`` is a served local pool running SmolLM2-135M (the cost in context).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid

from tokenlake.core.errors import TokenLakeError
from tokenlake.tools.bench.serve_stats import percentile


def _summary(xs: list[float]) -> dict[str, float]:
    return {"p50": percentile(xs, 50), "p10": percentile(xs, 10), "p90": percentile(xs, 90),
            "min": min(xs), "max": max(xs)}


async def _direct(loop, prompt: list[int], max_tokens: int) -> float:
    from tokenlake.generation.requests import GenerationRequest

    start = time.perf_counter()
    stream = await loop.submit(GenerationRequest(f"direct-{uuid.uuid4().hex}", tuple(prompt),
                                                 max_tokens, ()))
    async for _ in stream:
        pass
    return time.perf_counter() - start


async def _http(client, url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    start = time.perf_counter()
    r = await client.post(url, json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                     "temperature": 0, "ignore_eos": True})
    if r.status_code != 200:
        raise TokenLakeError(f"HTTP {r.status_code}: {r.text[:200]}")
    return time.perf_counter() - start


async def _alternate(svc, pairs: int, prompt_tokens: int, max_tokens: int, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    vocab = svc.http.app.state.model.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(17, vocab) for _ in range(prompt_tokens)]

    url = svc.http.url + "/v1/completions"
    model = svc.http.app.state.model.name
    direct, http = [], []
    async with httpx.AsyncClient(timeout=300) as client:
        for i in range(pairs + 1):  # the first pair warms both paths up, unmeasured
            d = await _direct(svc.http.loop, prompt(), max_tokens)
            h = await _http(client, url, model, prompt(), max_tokens)
            if i:
                direct.append(d)
                http.append(h)
    return {"direct_ms": _summary([x * 1e3 for x in direct]),
            "http_ms": _summary([x * 1e3 for x in http]),
            "overhead_ms": (statistics.median(http) - statistics.median(direct)) * 1e3,
            "overhead_paired_ms": statistics.median(h - d for h, d in zip(http, direct)) * 1e3}


class _Instant:
    """A serving backend with no model: every live request gets all its tokens (token
    id 17 each) in one iteration."""

    def __init__(self) -> None:
        self.on_token = None
        self.results: dict = {}
        self.live: dict = {}

    @property
    def busy(self) -> bool:
        return bool(self.live)

    def counts(self) -> tuple[int, int]:
        return 0, len(self.live)

    def submit(self, req):
        from tokenlake.generation.requests import RequestResult

        self.results[req.request_id] = res = RequestResult(req.request_id, req.prompt_ids)
        self.live[req.request_id] = req
        return res

    def step(self) -> None:
        for rid, req in list(self.live.items()):
            res = self.results[rid]
            for i in range(req.max_new_tokens):
                res.output_ids.append(17)
                if i == req.max_new_tokens - 1:
                    res.done, res.finish_reason = True, "length"
                    del self.live[rid]
                self.on_token(rid, 17)

    def cancel(self, rid: str) -> bool:
        req = self.live.pop(rid, None)
        if req is not None:
            self.results[rid].done, self.results[rid].finish_reason = True, "abort"
        return req is not None

    def pop_result(self, rid: str):
        res = self.results.get(rid)
        return self.results.pop(rid) if res is not None and res.done else None


class _Svc:  # what _alternate reads of a service
    def __init__(self, http) -> None:
        self.http = http


def bench_http(pairs: int = 30, prompt_tokens: int = 64, max_tokens: int = 4,
               instances: int = 2, seed: int = 0, backend: str = "instant") -> dict:
    """Medians and ranges of both paths and the HTTP overhead (ms); see the module."""
    from tokenlake.deploy.local import LocalCluster
    from tokenlake.service.frontend import HttpFrontend
    from tokenlake.service.http import ModelInfo
    from tokenlake.service.serve import SERVED_MODEL, load_served_model, pool_service

    weights, tok = load_served_model(lambda _: None)
    cfg = weights.config
    if backend == "instant":
        info = ModelInfo(SERVED_MODEL, tok, cfg.max_context, cfg.vocab_size)
        with HttpFrontend(_Instant(), info, port=0) as http:
            result = asyncio.run(_alternate(_Svc(http), pairs, prompt_tokens, max_tokens, seed))
    else:
        spec = cfg.to_model_spec(SERVED_MODEL)
        with LocalCluster(instances, spec, 64 << 20, segment_tokens=64,
                          max_rows=512) as cluster, \
                pool_service(cluster, control_port=0, http_port=0, model=(weights, tok)) as svc:
            result = asyncio.run(_alternate(svc, pairs, prompt_tokens, max_tokens, seed))
    result["config"] = {"backend": backend, "pairs": pairs, "prompt_tokens": prompt_tokens,
                        "max_tokens": max_tokens,
                        "instances": instances if backend == "pool" else None}
    return result

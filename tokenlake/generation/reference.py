"""The baseline server: the same model and requests, no pool and no prefix cache.

:class:`ReferenceLoop` has the :class:`~tokenlake.generation.loop.Server`'s service
interface (``submit``, ``step``, ``cancel``, ``pop_result``, ``busy``) over the plain
:class:`~tokenlake.model.llama.reference.ReferenceEngine`: every request keeps its own
KV cache in this process and prefills its whole prompt, however much of it an earlier
request shared. Iterations batch like a serving engine does (continuous batching, the pool
service's :class:`scheduler.continuous.ContinuousBatching`): each one decodes every
running request in one batched step and prefills up to ``chunk_tokens`` prompt tokens,
the oldest requests first.

``tokenlake serve --engine reference`` puts it behind the same HTTP layer as the pool,
so ``tokenlake bench serve`` compares the two with everything else equal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenlake.generation.requests import GenerationRequest, RequestResult, check_request
from tokenlake.generation.sampling import next_token
from tokenlake.model.llama.reference import KVCache, ReferenceEngine


class _Seq:
    __slots__ = ("req", "result", "cache", "prefilled", "generator")

    def __init__(self, req: GenerationRequest, result: RequestResult, config, kv_dtype, device) -> None:
        self.req, self.result = req, result
        self.cache = KVCache.empty(config, min(len(req.prompt_ids) + req.max_new_tokens,
                                               config.max_context), kv_dtype, device)
        self.prefilled = 0
        self.generator = req.sampling.generator()


class ReferenceLoop:
    """Continuous batching on the reference engine (see the module docstring).

    Args:
        weights: the model.
        chunk_tokens: most prompt tokens prefilled per iteration.
        on_token: ``on_token(request_id, token_id)``, after the result is updated.
            (``on_error(request_id, message)``, set after construction, hears of a
            request that failed on its own, as on :class:`~tokenlake.generation.loop.Server`.)
        kv_dtype: the element type of the KV caches (attention math stays float32).
    """

    def __init__(self, weights, chunk_tokens: int = 512,
                 on_token: Callable[[str, int], None] | None = None,
                 kv_dtype: torch.dtype = torch.float32) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.engine = ReferenceEngine(weights, kv_dtype)
        self.cfg = weights.config
        self.chunk_tokens = chunk_tokens
        self.on_token = on_token
        self.on_error: Callable[[str, str], None] | None = None  # a request failed alone
        self.results: dict[str, RequestResult] = {}
        self._live: dict[str, _Seq] = {}  # in arrival order
        self.iterations = 0

    @property
    def busy(self) -> bool:
        return bool(self._live)

    def counts(self) -> tuple[int, int]:
        """``(waiting, running)``: requests not started yet, and started."""
        waiting = sum(1 for s in self._live.values() if s.prefilled == 0)
        return waiting, len(self._live) - waiting

    def submit(self, req: GenerationRequest) -> RequestResult:
        """Queues a request; raises :class:`BadRequest` without touching anything else."""
        check_request(req, self.cfg, self.results)
        result = RequestResult(req.request_id, req.prompt_ids)
        self.results[req.request_id] = result
        self._live[req.request_id] = _Seq(req, result, self.cfg, self.engine.kv_dtype, self.engine.weights.device)
        return result

    def step(self) -> None:
        """One iteration: a batched decode step of the running requests, then prefill
        chunks of up to ``chunk_tokens`` prompt tokens in all, oldest request first."""
        decoding = [s for s in self._live.values() if s.result.output_ids]
        if decoding:
            logits = self.engine.decode_batch([s.cache for s in decoding],
                                              [s.result.output_ids[-1] for s in decoding])
            for s, row in zip(decoding, logits):
                self._emit(s, row)
        budget = self.chunk_tokens
        for s in [s for s in self._live.values() if not s.result.output_ids]:
            if budget < 1:
                break
            prompt = s.req.prompt_ids
            chunk = prompt[s.prefilled: s.prefilled + budget]
            with torch.inference_mode():
                row = self.engine.extend(s.cache, chunk)
            s.prefilled += len(chunk)
            s.result.prefill_tokens += len(chunk)
            budget -= len(chunk)
            if s.prefilled == len(prompt):
                self._emit(s, row)
        self.iterations += 1

    def _emit(self, s: _Seq, logits: torch.Tensor) -> None:
        """As :meth:`GenerationLoop._emit <tokenlake.generation.loop.Server._emit>`: a fault of
        this request alone ends it with ``finish_reason == "error"``, the others go on."""
        req, res = s.req, s.result
        try:
            token = next_token(logits, req.sampling, s.generator)
            if not 0 <= token < self.cfg.vocab_size:
                raise ValueError(f"sampled token {token} is outside the vocabulary "
                                 f"[0, {self.cfg.vocab_size})")
            res.output_ids.append(token)
            if token in req.stop_ids or len(res.output_ids) >= req.max_new_tokens:
                res.done, res.finish_reason = True, "stop" if token in req.stop_ids else "length"
                del self._live[req.request_id]
            if self.on_token is not None:
                self.on_token(res.request_id, token)
        except Exception as e:
            self._fail(s, e)

    def _fail(self, s: _Seq, error: Exception) -> None:
        res = s.result
        res.error = f"{type(error).__name__}: {error}"
        self._live.pop(res.request_id, None)
        res.done, res.finish_reason = True, "error"
        if self.on_error is not None:
            self.on_error(res.request_id, res.error)

    def cancel(self, request_id: str) -> bool:
        s = self._live.pop(request_id, None)
        if s is None:
            return False
        s.result.done, s.result.finish_reason = True, "abort"
        return True

    def pop_result(self, request_id: str) -> RequestResult | None:
        res = self.results.get(request_id)
        if res is None or not res.done:
            return None
        return self.results.pop(request_id)

"""The serving loop: requests in, iterations scheduled, tokens out (greedy).

Each iteration a policy picks the batches: here first-come-first-served with chunked
prefill (the goodput scheduler of issue #5 will drive the same loop). New requests
reuse whatever prefix the pool holds (whole segments, matched in the global tree);
their sealed segments are published to the tree as they fill, so a later turn of the
same session, or another request with the same document, prefills only what is new.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tokenlake.compute import ComputeEngine
from tokenlake.errors import TokenLakeError
from tokenlake.plans import Batch, BatchRequest


class BadRequest(TokenLakeError, ValueError):
    """A request the server cannot serve (empty, unknown token ids, too long)."""


@dataclass(frozen=True)
class GenerationRequest:
    """``prompt_ids`` to continue greedily for at most ``max_new_tokens``."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 32
    stop_ids: tuple[int, ...] = (2,)


@dataclass
class RequestResult:
    """What happened to one request (filled in as it runs)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: list[int] = field(default_factory=list)
    hit_tokens: int = 0  # prompt tokens served from the pool at admission
    prefill_tokens: int = 0  # prompt tokens computed
    logits: list[torch.Tensor] = field(default_factory=list)  # last-row logits per output token
    done: bool = False


@dataclass
class _Live:
    req: GenerationRequest
    result: RequestResult
    computed: int = 0  # prompt tokens whose KV is in the pool for this request
    admitted: bool = False


class Server:
    """Greedy generation through the pool with FCFS chunked prefill.

    Args:
        cluster: a running :class:`~tokenlake.cluster.LocalCluster`.
        weights: model weights (the compute engine is stateless).
        chunk_tokens: most prompt tokens one request prefills per iteration.
        keep_logits: keep every step's logits in the results (tests compare them).
        on_token: called as ``on_token(request_id, token_id)`` for streaming.
        rebalance_every: run heavy-hitter replication every this many iterations
            (0: never).
    """

    def __init__(self, cluster, weights, chunk_tokens: int = 512, keep_logits: bool = False,
                 on_token: Callable[[str, int], None] | None = None, rebalance_every: int = 4) -> None:
        if chunk_tokens > cluster.max_rows:
            raise ValueError(f"chunk_tokens={chunk_tokens} exceeds the cluster's max_rows={cluster.max_rows}")
        self.cluster = cluster
        self.engine = ComputeEngine(weights, cluster)
        self.cfg = weights.config
        self.chunk_tokens = chunk_tokens
        self.keep_logits = keep_logits
        self.on_token = on_token
        self._waiting: deque[_Live] = deque()
        self._running: dict[str, _Live] = {}
        self.results: dict[str, RequestResult] = {}
        self.iterations = 0
        self.rebalance_every = rebalance_every
        self.replications = 0

    # ------------------------------------------------------------- requests
    def submit(self, req: GenerationRequest) -> RequestResult:
        """Queues a request; raises :class:`BadRequest` without touching anything else."""
        self._check(req)
        result = RequestResult(req.request_id, req.prompt_ids)
        self.results[req.request_id] = result
        self._waiting.append(_Live(req, result))
        return result

    def _check(self, req: GenerationRequest) -> None:
        if req.request_id in self.results:
            raise BadRequest(f"request id {req.request_id!r} was already used")
        if not req.prompt_ids:
            raise BadRequest(f"request {req.request_id!r}: empty prompt")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise BadRequest(f"request {req.request_id!r}: token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        if req.max_new_tokens < 1:
            raise BadRequest(f"request {req.request_id!r}: max_new_tokens must be >= 1")
        total = len(req.prompt_ids) + req.max_new_tokens
        if total > self.cfg.max_context:
            raise BadRequest(f"request {req.request_id!r}: {total} tokens exceed the context limit {self.cfg.max_context}")

    # ------------------------------------------------------------ iterations
    def run(self, requests: Sequence[GenerationRequest] = ()) -> dict[str, RequestResult]:
        """Submits ``requests`` and iterates until every request is done."""
        for r in requests:
            self.submit(r)
        while self._waiting or self._running:
            self.step()
        return self.results

    def step(self) -> None:
        """One iteration: FCFS batches, plans, compute, completion."""
        batches, prefilling = self._schedule()
        if not batches:
            return
        cp = self.cluster.control
        plans = cp.gen_plans(batches, [1] * len(batches))
        try:
            out = self.engine.run(plans, batches)
        except BaseException:
            cp.abort(plans)
            raise
        cp.complete(plans)
        self.iterations += 1
        if self.rebalance_every and self.iterations % self.rebalance_every == 0:
            reps = cp.rebalance()  # between iterations: no plan is in flight
            self.cluster.replicate(reps)
            self.replications += len(reps)
        for rid, logits in out.logits.items():
            live = self._running[rid]
            if rid in prefilling and live.computed < len(live.req.prompt_ids):
                continue  # a prefill chunk that is not the prompt's last
            self._emit(live, logits)

    def _schedule(self) -> tuple[list[Batch], set[str]]:
        slots = len(self.cluster.control.pool.instances)
        batches: list[Batch] = []
        decode = [BatchRequest(rid, (live.result.output_ids[-1],))
                  for rid, live in self._running.items() if live.computed >= len(live.req.prompt_ids)]
        if decode:
            batches.append(Batch(tuple(decode), "decode"))
        prefilling = set()
        for rid, live in self._running.items():  # continue chunked prefills first
            if len(batches) < slots and live.computed < len(live.req.prompt_ids):
                batches.append(Batch((self._chunk(live),), "prefill"))
                prefilling.add(rid)
        while self._waiting and len(batches) < slots:
            live = self._waiting.popleft()
            self._running[live.req.request_id] = live
            batches.append(Batch((self._chunk(live),), "prefill"))
            prefilling.add(live.req.request_id)
        return batches, prefilling

    def _chunk(self, live: _Live) -> BatchRequest:
        prompt = live.req.prompt_ids
        prefix: tuple[int, ...] = ()
        if not live.admitted:
            tree = self.cluster.control.get_prefix_tree()
            hit = tree.match(prompt, max_tokens=len(prompt) - 1).hit_tokens
            prefix, live.computed, live.admitted = prompt[:hit], hit, True
            live.result.hit_tokens = hit
        stop = min(len(prompt), live.computed + self.chunk_tokens)
        new = prompt[live.computed : stop]
        live.result.prefill_tokens += len(new)
        live.computed = stop
        return BatchRequest(live.req.request_id, new, prefix)

    def _emit(self, live: _Live, logits: torch.Tensor) -> None:
        token = int(torch.argmax(logits))
        res = live.result
        res.output_ids.append(token)
        if self.keep_logits:
            res.logits.append(logits.clone())
        if self.on_token is not None:
            self.on_token(res.request_id, token)
        if token in live.req.stop_ids or len(res.output_ids) >= live.req.max_new_tokens:
            res.done = True
            del self._running[res.request_id]
            self.cluster.control.finish_request(res.request_id)

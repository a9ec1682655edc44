"""A compute engine on a served pool for ``tokenlake bench serve --mixed``.

:class:`PoolWorker` drives a pool through ``tokenlake.connect`` as a serving framework's
worker would, with the synthetic model of :mod:`tokenlake.tools.synthetic_kv` instead
of weights. It learns the model's attention shape from its session's client buffers and
the segment size from the pool, so it needs no model argument. Each request:

* a prompt of 0 to 3 segments of a document every worker of the run shares (the same
  ``doc_seed``), then 3 to ``C`` tokens of its own; the cached part of it is matched, the
  rest prefilled in one iteration;
* then 1 to 3 decode iterations of one token each.

An iteration plans, puts the new tokens' synthetic K/V and queries the pool layer by
layer, and completes; afterwards every layer's partial attention over the prefix is
compared with the float64 reference of the K/V its tokens stand for
(:func:`~tokenlake.tools.synthetic_kv.reference_partial`): an iteration with any layer
off by more than the tolerance is a wrong answer. A request whose segment another
client is still storing (``SegmentInFlight``) waits 10 ms and is planned again (counted
in ``waits_in_flight``); a prefix evicted between the match and the plan is matched
again; any other failure of an iteration is an error (the request ends, the next
begins).

Prompt tokens are ids in ``[3, 17)`` only (SmolLM2's control tokens; no text prompt and
no ``bench serve`` HTTP prompt has 16 of them in a row), so the synthetic K/V never
becomes the cached prefix of a real request, nor a real request's the workers'.

As a process (``python -m tokenlake.tools.bench.serve_worker --address ... --worker I``)
it connects, prints ``{"event": "ready", ...}`` and obeys lines on stdin: ``run`` (until
``pause``), ``run K`` (K iterations), ``pause``; it answers each run with ``{"event":
"paused", ...}`` once its current iteration is done (a run does at least one). At the
end of stdin it closes its session and prints its report, one JSON line
(:func:`~tokenlake.tools.bench.serve_stats.worker_summary`).
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from tokenlake.core.errors import PrefixNotCached, SegmentInFlight, TokenLakeError
from tokenlake.core.plans import Batch, BatchRequest, Plans
from tokenlake.tools.bench.serve_stats import worker_summary
from tokenlake.tools.synthetic_kv import (
    KVShape,
    difference,
    query_rows,
    reference_partial,
    token_kv,
)

TOKEN_RANGE = (3, 17)  # [lo, hi): control-token ids, never a text prompt's run of tokens
DOC_SEGMENTS = 3
MAX_DECODE_STEPS = 3


@dataclass(frozen=True)
class WorkerOptions:
    """One worker: its number, the seed of its own tokens and choices, the seed of the
    document all workers of a run share, how long a request may wait for another
    client's segment (seconds), and the largest difference from the reference that is
    still right (None: 1e-4 on a CPU pool, 2e-2 on a GPU pool, whose FlashInfer rounds
    q to the KV dtype)."""

    worker: int = 0
    seed: int = 0
    doc_seed: int = 0
    wait_limit_s: float = 60.0
    tolerance: float | None = None


@dataclass
class WorkerStats:
    """What a worker did (mutated as it runs). ``active_s``: seconds spent running
    requests (reference checks included); ``latencies_s``: each iteration's time from
    planning (waits included) to its completion; ``tokens``: new tokens stored and
    queried; ``hit_tokens``: prefix tokens attended through the pool."""

    iterations: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    active_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    error_samples: Counter = field(default_factory=Counter)
    wrong_answers: int = 0
    worst_error: float = 0.0
    waits_in_flight: int = 0
    layers_checked: int = 0

    @property
    def attempts(self) -> int:
        """Iterations tried: done or failed."""
        return self.iterations + self.errors


Reference = Callable[..., object]  # reference_partial's signature


class PoolWorker:
    """A compute engine on the pool ``cp`` (a ``tokenlake.connect`` control plane).
    ``reference`` computes the expected partial (:func:`reference_partial`; a test may
    pass a wrong one to see it caught). Not thread-safe: one thread drives it."""

    def __init__(self, cp, options: WorkerOptions, reference: Reference = reference_partial) -> None:
        self.cp, self.options, self.reference = cp, options, reference
        self.shape: KVShape | None = None
        self.segment_tokens = 0
        self._doc: list[int] = []
        self._rng = random.Random(f"tokenlake-bench-worker-{options.seed}-{options.worker}")
        self._requests = 0

    def setup(self) -> KVShape:
        """Opens the session, reads the model's shape from its buffers on the first
        instance and the segment size from the pool; returns the shape."""
        first = min(self.cp.instances)
        self.shape = KVShape.from_buffers(self.cp.client_info(first).buffers)
        _namespace, self.segment_tokens = self.cp.layout()
        doc_rng = random.Random(f"tokenlake-bench-doc-{self.options.doc_seed}")
        self._doc = [doc_rng.randrange(*TOKEN_RANGE)
                     for _ in range(DOC_SEGMENTS * self.segment_tokens)]
        return self.shape

    @property
    def tolerance(self) -> float:
        if self.options.tolerance is not None:
            return self.options.tolerance
        return 2e-2 if self.shape.device.startswith("cuda") else 1e-4

    # ------------------------------------------------------------ the loop
    def drive(self, stats: WorkerStats, stop: threading.Event | None = None,
              limit: int | None = None) -> None:
        """Runs requests until ``limit`` more iterations were tried (done or failed) or,
        without a limit, until ``stop`` is set (checked after every iteration, so at
        least one runs); the request of the last iteration is ended."""
        goal = None if limit is None else stats.attempts + limit

        def done() -> bool:
            if goal is not None:
                return stats.attempts >= goal
            return stop is not None and stop.is_set()

        start = time.perf_counter()
        try:
            while True:
                self._request(stats, done)
                if done():
                    return
        finally:
            stats.active_s += time.perf_counter() - start

    def _prompt(self) -> list[int]:
        c = self.segment_tokens
        shared = self._doc[: self._rng.randrange(DOC_SEGMENTS + 1) * c]
        own = [self._rng.randrange(*TOKEN_RANGE) for _ in range(self._rng.randint(3, c))]
        return (shared + own)[: self.shape.max_rows]

    def _request(self, stats: WorkerStats, done: Callable[[], bool]) -> None:
        """One request: a prefill iteration, then decode iterations until it has 1-3 or
        ``done()`` says stop; it is finished whatever happens."""
        rid = f"w{self.options.worker}-r{self._requests}"
        self._requests += 1
        prompt = self._prompt()
        try:
            if not self._prefill(stats, rid, prompt):
                return
            for _ in range(self._rng.randint(1, MAX_DECODE_STEPS)):
                if done():
                    return
                prompt.append(self._rng.randrange(*TOKEN_RANGE))
                batch = Batch((BatchRequest(rid, (prompt[-1],)),), "decode")
                if not self._iteration(stats, rid, batch, prompt, 1):
                    return
        finally:
            try:
                self.cp.finish_request(rid)
            except TokenLakeError:
                pass  # never planned (an error before), or the session ended: nothing held

    def _prefill(self, stats: WorkerStats, rid: str, prompt: list[int]) -> bool:
        for _ in range(3):  # a prefix evicted between the match and the plan: match again
            hit = self.cp.get_prefix_tree().match(prompt, max_tokens=len(prompt) - 1).hit_tokens
            batch = Batch((BatchRequest(rid, tuple(prompt[hit:]), tuple(prompt[:hit])),))
            try:
                return self._iteration(stats, rid, batch, prompt, len(prompt) - hit,
                                       retry_evicted=True)
            except PrefixNotCached:
                continue
        return self._failed(stats, PrefixNotCached("the prefix was evicted three times"))

    def _failed(self, stats: WorkerStats, exc: BaseException) -> bool:
        stats.errors += 1
        stats.error_samples[f"{type(exc).__name__}: {exc}"[:200]] += 1
        return False

    def _iteration(self, stats: WorkerStats, rid: str, batch: Batch, prompt: list[int],
                   new: int, retry_evicted: bool = False) -> bool:
        """Plans, runs and completes one iteration, then checks it; False if it failed
        (counted as an error). ``PrefixNotCached`` propagates with ``retry_evicted``."""
        t0 = time.perf_counter()
        try:
            plans = self._plan(stats, batch)
            try:
                results = self._execute(plans, prompt)
            except BaseException:
                self.cp.abort(plans)
                raise
            self.cp.complete(plans)
        except PrefixNotCached:
            if retry_evicted:
                raise
            return self._failed(stats, PrefixNotCached("prefix not cached"))
        except TokenLakeError as exc:
            return self._failed(stats, exc)
        stats.latencies_s.append(time.perf_counter() - t0)
        stats.iterations += 1
        stats.tokens += new
        self._check(stats, results, prompt)
        return True

    def _plan(self, stats: WorkerStats, batch: Batch) -> Plans:
        deadline = time.monotonic() + self.options.wait_limit_s
        while True:
            try:
                return self.cp.gen_plans([batch], [1])
            except SegmentInFlight:
                if time.monotonic() > deadline:
                    raise
                stats.waits_in_flight += 1
                time.sleep(0.01)  # the other client's iteration completes or is aborted

    def _execute(self, plans: Plans, prompt: list[int]) -> list[tuple]:
        """Puts the new tokens' K/V and queries the pool, layer by layer; returns
        ``(layer, span, q, o, lse)`` per span and layer, on the host."""
        shape, out = self.shape, []
        for qp, tp in zip(plans.query_plans, plans.transfer_plans):
            client = self.cp.client(qp.home)
            q_buf, kv_buf = client.init_plans(qp, tp)
            handles = []
            for layer in range(shape.num_layers):
                for s in qp.spans:
                    n = s.stop - s.start
                    kv_buf[layer, s.start:s.stop] = token_kv(
                        prompt[s.position:s.position + n], s.position, layer, shape)
                handles.append(client.put(layer))
                for s in qp.spans:
                    q_buf[s.start:s.stop] = query_rows(s.request_id, s.position,
                                                       s.stop - s.start, layer, shape)
                part = client.query(layer)
                for s in qp.spans:
                    rows = slice(s.start, s.stop)
                    out.append((layer, s, q_buf[rows].cpu().clone(), part.o[rows].cpu().clone(),
                                part.lse[rows].cpu().clone()))
            for h in handles:
                h.wait()
        return out

    def _check(self, stats: WorkerStats, results: list[tuple], prompt: list[int]) -> None:
        worst = 0.0
        for layer, span, q, o, lse in results:
            stats.layers_checked += 1
            stats.hit_tokens += span.prefix_tokens if layer == 0 else 0
            if span.prefix_tokens == 0:  # nothing to attend: -inf everywhere
                worst = max(worst, 0.0 if bool(torch.isneginf(lse).all()) else float("inf"))
                continue
            ref = self.reference(prompt, span.prefix_tokens, q, layer, self.shape)
            worst = max(worst, difference(o, lse, ref))
        stats.worst_error = max(stats.worst_error, worst)
        if not worst <= self.tolerance:
            stats.wrong_answers += 1


# --------------------------------------------------------------------------- the process


def _emit(event: str, **data) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def _read_commands(commands: queue.Queue, pause: threading.Event) -> None:
    """stdin lines to ``commands`` (None at its end); ``pause`` is set by ``pause`` and
    cleared by ``run``, in the order they arrive."""
    for line in sys.stdin:
        words = line.split()
        if words == ["run"] or (len(words) == 2 and words[0] == "run" and words[1].isdigit()
                                and int(words[1]) > 0):
            pause.clear()
            commands.put(int(words[1]) if len(words) > 1 else -1)
        elif words == ["pause"]:
            pause.set()  # anything else is ignored
    pause.set()
    commands.put(None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenlake.tools.bench.serve_worker")
    p.add_argument("--address", required=True, help="the pool's control address")
    p.add_argument("--credentials", default=None, help="its credentials file (default: "
                   "where tokenlake.connect looks)")
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--doc-seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per call to the pool")
    args = p.parse_args(argv)
    import tokenlake

    options = WorkerOptions(args.worker, args.seed, args.doc_seed)
    stats = WorkerStats()
    commands: queue.Queue = queue.Queue()
    pause = threading.Event()
    with tokenlake.connect(args.address, timeout_s=args.timeout, credentials=args.credentials,
                           label=f"bench-worker-{args.worker}") as cp:
        worker = PoolWorker(cp, options)
        shape = worker.setup()
        session = cp.session.session
        _emit("ready", worker=args.worker, session=session, segment_tokens=worker.segment_tokens,
              shape=asdict(shape))
        threading.Thread(target=_read_commands, args=(commands, pause), daemon=True).start()
        while (limit := commands.get()) is not None:
            worker.drive(stats, stop=pause, limit=None if limit < 0 else limit)
            _emit("paused", worker=args.worker, iterations=stats.iterations)
    print(json.dumps({"event": "report", **worker_summary(stats, args.worker, session)}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

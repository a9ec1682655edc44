"""Baselines whose workers keep their own prefix caches (no pool).

Each *worker* is ``tp`` GPUs (paper §7: TP=2) and runs SGLang-style iterations: its
prefill requests first (chunked), otherwise its decode requests, as
:class:`~scheduler.baselines.adapter.RoutedPolicy` decides. Which worker a request goes
to is the real router's decision (:class:`CacheAwareRouter` for ``sglang-router``,
:class:`RoundRobinRouter`, :class:`FlowKVRouter`), made when the request arrives.

What the router believes a worker caches (its approximate tree) and what the worker
really caches differ, as in SGLang: the real cache is a :class:`LocalCache` per worker,
a token-level radix tree (:class:`scheduler.baselines.radix.RadixTree`, one tenant) with
LRU leaf eviction, filled with a request's prompt when its prefill ends and with prompt
plus output when it finishes. A request's hit is its match in its worker's cache when
its prefill starts.

Worker memory (``cache_gb x tp``, in KV tokens) is shared by the cache and the running
requests: a request is admitted only if every running request's uncached prompt and
output still fit (SGLang reserves them), otherwise it waits for one to finish; the cache
is trimmed to what the running requests leave (:class:`Worker`).
"""

from __future__ import annotations

from array import array

import numpy as np

from evals.sim.backend import Backend, Run, SimRequest, SimulationError
from evals.sim.timing import ChunkSchedule, DecodeSchedule, decode_coefficients, iteration_s
from evals.sim.trace import decode_tokens, prompt_array
from scheduler.api import InstanceView, Snapshot
from scheduler.baselines.adapter import RoutedPolicy
from scheduler.baselines.flowkv import FlowKVRouter
from scheduler.baselines.radix import RadixTree
from tokenlake.generation.tracker import RequestTracker

ROUTER_EVICT = 20


class LocalCache:
    """One worker's prefix cache: token radix tree, LRU leaves evicted beyond a limit."""

    def __init__(self) -> None:
        self.tree = RadixTree()
        self.tree.add_tenant(0)

    @property
    def tokens(self) -> int:
        return self.tree.sizes[0]

    def match(self, tokens) -> int:
        return self.tree.match(tokens, tenant=0)[0]

    def insert(self, tokens, now: float, limit: int) -> None:
        self.tree.insert(tokens, 0, now)
        self.trim(limit)

    def trim(self, limit: int) -> None:
        if self.tree.sizes[0] > limit:
            self.tree.evict_tenant(0, max(limit, 0))


class Worker:
    """Memory of one worker, in KV tokens: its cache plus its running requests.

    As SGLang reserves memory at admission, a request holds its uncached prompt and its
    output (``holds_output=False`` for a prefill-only worker, whose outputs are decoded
    elsewhere); its cached prefix is inside the cache. The cache keeps what the running
    requests leave: the prompts of those still prefilling and every output.
    """

    def __init__(self, capacity: int, tracker: RequestTracker, holds_output: bool = True,
                 caches: bool = True) -> None:
        self.capacity = capacity
        self.tracker = tracker  # the backend's: admissions go through it
        self.holds_output = holds_output
        self.caches = caches  # False: a decode-only worker holds whole prompts
        self.cache = LocalCache()
        self.admitted: set[SimRequest] = set()

    def need(self, r: SimRequest, hit: int) -> int:
        return r.prompt_len - (hit if self.caches else 0) + (r.output_len if self.holds_output else 0)

    def held(self) -> int:
        return sum(self.need(r, r.hit) for r in self.admitted)

    def cache_limit(self) -> int:
        private = sum((r.output_len if self.holds_output else 0)
                      + (r.prompt_len - r.hit if r.phase == "prefill" else 0)
                      for r in self.admitted)
        return self.capacity - private

    def admit(self, r: SimRequest) -> bool:
        """Admits ``r`` with its hit in this cache if it fits; False if it must wait."""
        if self.need(r, 0) > self.capacity:
            raise SimulationError(f"request {r.request_id} needs {self.need(r, 0)} KV tokens; a "
                                  f"worker holds {self.capacity}")
        hit = min(self.cache.match(r.tokens), r.prompt_len - 1)
        if self.held() + self.need(r, hit) > self.capacity:
            return False
        self.tracker.admit(r, hit)
        self.admitted.add(r)
        self.cache.trim(self.cache_limit())
        return True


def admit_in_order(worker: Worker, reqs: list[SimRequest]) -> list[SimRequest]:
    """The requests of ``reqs`` (in arrival order) that can prefill on ``worker`` now:
    those admitted already, and new ones first come first served while their prompts
    fit. As SGLang's scheduler stops adding waiting requests at the first that does not
    fit, so do we: it and every later new request wait (blocked) for a request to leave.
    """
    ready, full = [], False
    for r in reqs:
        if r.admitted:
            ready.append(r)
        elif not full and worker.admit(r):
            ready.append(r)
        else:
            full, r.blocked = True, "memory"
    return ready


def local_prefill_run(b: Backend, reqs: list[SimRequest], tp: int, first_extra_s: float = 0.0) -> Run:
    """Chunked prefill of ``reqs`` on one worker until the first prompt completes
    (``first_extra_s``: added to the first chunk, e.g. a prefix fetch it waits for)."""
    chunk = b.config.chunk_tokens
    done = [r.prefilled for r in reqs]  # all admitted
    k = min(-(-(r.prompt_len - d) // chunk) for r, d in zip(reqs, done))
    chunks = [[min(chunk, r.prompt_len - d - j * chunk) for j in range(k)]
              for r, d in zip(reqs, done)]
    durations = [iteration_s(b.lat, [(c[j], d + j * chunk) for c, d in zip(chunks, done)], tp, 1.0)
                 for j in range(k)]
    durations[0] += first_extra_s
    return Run(reqs, "prefill", (reqs[0].worker,), 1, ChunkSchedule(b.now, durations), k, chunks)


def local_decode_run(b: Backend, reqs: list[SimRequest], tp: int) -> Run:
    ctx = [r.context for r in reqs]
    a, slope = decode_coefficients(b.lat, ctx, tp, 1.0, 0.0)
    if b.config.grouped_reads and len(reqs) > 1:  # the batch's common prefix read once (cascade)
        a -= b.lat.c_prefix * common_prefix([r.tokens for r in reqs]) * (len(reqs) - 1) / b.lat.speedup(tp)
    k = min(r.output_len - r.generated for r in reqs)
    return Run(reqs, "decode", (reqs[0].worker,), 1, DecodeSchedule(b.now, a, slope, k), k)


def common_prefix(prompts) -> int:
    """Tokens every one of ``prompts`` starts with (what a cascade kernel, as vLLM's,
    reads once for a whole decode batch)."""
    first = np.frombuffer(prompts[0], dtype=np.int32)
    n = len(first)
    for p in prompts[1:]:
        other = np.frombuffer(p, dtype=np.int32)
        m = min(n, len(other))
        diff = np.flatnonzero(first[:m] != other[:m])
        n = int(diff[0]) if len(diff) else m
        if n == 0:
            break
    return n


def local_reads(b: Backend, run: Run, j0: int, j1: int) -> None:
    """KV tokens each iteration reads from the worker's memory (its whole context)."""
    w = run.group[0]
    if run.phase == "decode":
        b.rec.run_reads(run.sched, j0, j1, {w: sum(r.context for r in run.reqs)})
        return
    base = [r.prefilled for r in run.reqs]
    for m in range(j0 + 1, j1 + 1):
        ctx = sum(base[i] + run.tokens_between(i, j0, m - 1) for i in range(len(run.reqs)))
        b.rec.reads(run.sched.end(m), {w: ctx})


def full_sequence(r: SimRequest) -> array:
    """Prompt plus the stand-in outputs, as cached when the request finishes."""
    return r.tokens + decode_tokens(r.idx, 0, r.output_len)


class FlowKVAdapter:
    """:class:`FlowKVRouter` behind the ``route``/``finish`` interface RoutedPolicy uses;
    the loop reports finished prefills with :meth:`prefill_done`."""

    def __init__(self, workers, capacity: int) -> None:
        self.router = FlowKVRouter(workers, kv_capacity=capacity)
        self.where: dict[str, tuple] = {}

    def route(self, rid, tokens) -> int:
        inst = self.router.route(len(tokens))
        self.where[rid] = (inst, len(tokens), False)
        return inst

    def prefill_done(self, rid) -> None:
        inst, n, _ = self.where[rid]
        self.router.prefill_done(inst, n)
        self.where[rid] = (inst, n, True)

    def finish(self, rid) -> int:
        inst, n, prefilled = self.where.pop(rid)
        if not prefilled:
            self.router.prefill_done(inst, n)
        self.router.decode_done(inst, n)
        return inst


class RoutedBackend(Backend):
    """Colocated prefill/decode workers behind a router (SGLang-Router and friends)."""

    def __init__(self, setup, system: str, router) -> None:
        tp = setup.config.tp
        n_workers = setup.instances // tp
        if n_workers < 1 or setup.instances % tp:
            raise ValueError(f"{setup.instances} GPUs do not split into TP={tp} workers")
        super().__init__(setup, system, range(n_workers))
        self.tp = tp
        self.workers = [Worker(setup.cache_tokens_per_gpu * tp, self.tracker) for _ in range(n_workers)]
        self.router = router
        self.policy = RoutedPolicy(router, lambda rid: self.tracker[rid].tokens, system,
                                   chunk_tokens=self.config.chunk_tokens)
        self._dirty = False  # something changed since the last decision

    def start(self) -> None:
        if hasattr(self.router, "evict"):
            self.push(self.config.router_evict_s, ROUTER_EVICT, None)

    def handle(self, kind: int, obj) -> None:
        if kind != ROUTER_EVICT:
            raise ValueError(f"unknown event kind {kind}")
        self.router.evict()
        if self.runs or any(e[2] != ROUTER_EVICT for e in self._heap):
            self.push(self.now + self.config.router_evict_s, ROUTER_EVICT, None)

    def on_arrival(self, req: SimRequest) -> None:
        req.tokens = prompt_array(req.source)
        self._dirty = True

    def decide(self) -> None:
        if not self._dirty:  # only timers fired: nothing a router or worker would see
            return
        self._dirty = False
        tracker = self.tracker
        if not self.free_instances() and all(r.worker is not None for r in tracker.values()):
            return
        # A request's hit is known only when its worker admits it: until then it shows
        # its whole prompt (the tracker's view of a waiting request with hit 0).
        views = tuple(tracker.view(r) for r in tracker.values())
        snap = Snapshot(self.now, (), views,
                        tuple(InstanceView(w, w in self.busy) for w in self.instance_ids),
                        0.0, self.lat)
        decision = self.policy.schedule(snap)
        self.scheduler_calls += 1
        for rid, w in self.policy.placement.items():
            tracker[rid].worker = w
        for batch, w in zip(decision.batches, self.policy.batch_instances(decision)):
            self._start(w, [tracker[rid] for rid in batch.request_ids], batch.phase)

    def _start(self, w: int, reqs: list[SimRequest], phase: str) -> None:
        worker = self.workers[w]
        reqs = [r for r in reqs if r.run is None and r.blocked is None]
        if phase == "prefill":
            ready = admit_in_order(worker, reqs)
            if ready:
                self.start_run(self.prefill_run(ready))
                return
            reqs = [r for r in self.tracker.values() if r.worker == w and r.phase == "decode"
                    and r.run is None]
        if reqs:
            self.start_run(local_decode_run(self, reqs, self.tp))

    def prefill_run(self, ready: list[SimRequest]) -> Run:
        return local_prefill_run(self, ready, self.tp)

    def commit(self, run: Run, j0: int, j1: int) -> None:
        local_reads(self, run, j0, j1)

    def run_done(self, run: Run) -> None:
        self._dirty = True
        worker = self.workers[run.group[0]]
        for r in run.reqs:
            if run.phase == "prefill" and r.prefilled >= r.prompt_len:
                worker.cache.insert(r.tokens, self.now, worker.cache_limit())
                if isinstance(self.router, FlowKVAdapter):
                    self.router.prefill_done(r.request_id)

    def on_finish(self, req: SimRequest) -> None:
        worker = self.workers[req.worker]
        worker.admitted.discard(req)
        worker.cache.insert(full_sequence(req), self.now, worker.cache_limit())
        req.tokens = None
        for r in self.tracker.values():
            if r.blocked == "memory" and r.worker == req.worker:
                r.blocked = None

    def continues(self, run: Run, waiting: list[SimRequest], idle: list) -> bool:
        w = run.group[0]
        return not any(r.worker == w or r.worker is None for r in waiting)

    def extra(self) -> dict:
        return {"workers": len(self.workers), "tp": self.tp,
                "worker_cache_tokens": [wk.cache.tokens for wk in self.workers],
                "worker_capacity_tokens": self.workers[0].capacity}

"""A BanaServe-style global KV store behind purely load-based routing (issue #20).

The design TokenLake argues against most directly: every worker's cache memory forms
one prefix store that any worker can fetch from, and since any worker can reach any
prefix the router balances load only (:class:`~scheduler.baselines.least_load.LeastLoadRouter`:
fewest requests in flight). Modelled here on the colocated workers of
:mod:`evals.sim.unpooled` (``tp`` GPUs each, SGLang-style iterations):

* **Store.** One token radix tree with LRU leaf eviction (:class:`~evals.sim.unpooled.LocalCache`)
  over the memory of all workers that their running requests leave; a request's hit is
  its longest prefix there when its worker admits it; prompts go in when their prefill
  ends, prompt plus output when the request finishes.
* **Memory.** As SGLang reserves it: a running request holds its uncached prompt and
  its output on its worker; its fetched prefix counts in the store (a copy fetched to a
  worker is a replica there, shared by the requests that use it), once.
* **Fetch.** The hit's KV comes over the network from where it is stored: on average the
  share ``(W - 1) / W`` held by the other ``W - 1`` workers, at the worker's bandwidth
  (``tp x net_bw``, each GPU fetching its shard), plus a round trip. Layer by layer, layer
  ``l + 1`` is fetched while layer ``l`` computes, so the request's first chunk waits
  ``max(0, fetch - compute) + fetch / layers`` beyond its compute (the pipeline's fill),
  from the same network model the other systems use.
"""

from __future__ import annotations

from evals.sim.backend import Run, SimRequest
from evals.sim.unpooled import LocalCache, RoutedBackend, Worker, local_prefill_run
from scheduler.baselines.least_load import LeastLoadRouter


class StoreWorker(Worker):
    """A worker whose cache is the global store, trimmed to what all workers' running
    requests leave."""

    def __init__(self, capacity: int, tracker, store: LocalCache, peers: list[Worker]) -> None:
        super().__init__(capacity, tracker)
        self.cache = store
        self.peers = peers

    def cache_limit(self) -> int:
        return sum(Worker.cache_limit(w) for w in self.peers)


class GlobalStoreBackend(RoutedBackend):
    def __init__(self, setup, system: str) -> None:
        n = setup.instances // setup.config.tp
        super().__init__(setup, system, LeastLoadRouter(list(range(n))))
        store, peers = LocalCache(), []
        peers.extend(StoreWorker(setup.cache_tokens_per_gpu * self.tp, self.tracker, store, peers)
                     for _ in range(len(self.workers)))
        self.workers = peers
        self.fetches, self.fetch_s = 0, 0.0

    def fetch_s_of(self, hit_tokens: int) -> float:
        """Seconds to fetch ``hit_tokens`` of prefix KV to one worker (all layers)."""
        hw, n = self.setup.hardware, len(self.workers)
        remote = hit_tokens * self.setup.model.kv_bytes_per_token * (n - 1) / n
        return 2 * hw.net_latency_s + remote / (hw.net_bw * self.tp)

    def prefill_run(self, ready: list[SimRequest]) -> Run:
        run = local_prefill_run(self, ready, self.tp)
        fresh = sum(r.hit for r in ready if r.hit and r.prefilled == r.hit)
        if not fresh or len(self.workers) < 2:
            return run
        fetch = self.fetch_s_of(fresh)
        compute = run.sched.end(1) - run.sched.t0
        self.fetches += 1
        self.fetch_s += fetch
        extra = max(0.0, fetch - compute) + fetch / self.setup.model.num_layers
        return local_prefill_run(self, ready, self.tp, first_extra_s=extra)

    def extra(self) -> dict:
        out = super().extra()
        out.update(kv_fetches=self.fetches, kv_fetch_s=self.fetch_s,
                   store_tokens=self.workers[0].cache.tokens)
        del out["worker_cache_tokens"]
        return out

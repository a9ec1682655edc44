"""SGLang-Router cache-aware routing (the paper's "SGLang-Router" baseline, docs/design.md §6).

Decision rule, read from sgl-router's ``src/policies/cache_aware.rs`` and
``src/tree.rs`` (sgl-project/sglang, ``sgl-router/``, commits 026f853 and b6f2064) and
re-written here over token ids instead of characters (so ``max_tree_size`` counts tokens
where sgl-router counts characters):

1. load = in-flight requests per worker. The system is *imbalanced* iff
   ``max - min > balance_abs_threshold`` AND ``max > balance_rel_threshold * min``.
   Imbalanced -> the least-loaded worker (first in worker order on ties).
2. Balanced -> walk the one shared approximate radix tree; the workers at the deepest
   matched node hold the longest prefix; ``match_rate = matched / len(request)``.
   ``match_rate > cache_threshold`` (strict) -> that worker. If several hold the same
   longest prefix sgl-router takes an arbitrary one (first in a hash map); we take the
   one that used it most recently, then worker order, to stay deterministic.
3. Otherwise (a miss) ``miss_policy`` decides:
   ``"least_load"`` (default) -> the least-loaded worker by in-flight requests, following
   the ``sglang-router`` 0.3.x wheel on PyPI; ``"smallest_tree"`` -> the worker whose
   tree holds the fewest tokens (``get_smallest_tenant``), the rule in the two source
   commits named above. Ties go to the first worker in order.
4. Every routed request is inserted into the tree under the chosen worker (also when
   imbalanced), stamping the whole path with the clock's time.

``evict()`` does what sgl-router's periodic eviction thread does: for each worker whose
tree exceeds ``max_tree_size`` tokens, drop its least recently used leaves until it fits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence

from scheduler.baselines.inflight import InFlight

from .radix import RadixTree

MISS_POLICIES = ("least_load", "smallest_tree")


def _logical_clock() -> Callable[[], float]:
    counter = itertools.count(1)
    return lambda: float(next(counter))


class CacheAwareRouter:
    def __init__(
        self,
        workers: Sequence[Hashable],
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 2**24,
        miss_policy: str = "least_load",
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not workers:
            raise ValueError("need at least one worker")
        if len(set(workers)) != len(workers):
            raise ValueError("duplicate worker ids")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0 or max_tree_size < 0:
            raise ValueError("invalid balance thresholds or max_tree_size")
        if miss_policy not in MISS_POLICIES:
            raise ValueError(f"miss_policy must be one of {MISS_POLICIES}")
        self.workers = list(workers)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.miss_policy = miss_policy
        self.clock = clock or _logical_clock()
        self.tree = RadixTree()
        for w in self.workers:
            self.tree.add_tenant(w)
        self._flight = InFlight(self.workers)
        self.in_flight = self._flight.counts  # worker -> requests in flight
        self.last_reason = ""  # "imbalanced" | "hit" | "miss", for inspection

    # -- decision ---------------------------------------------------------------
    def is_imbalanced(self) -> bool:
        loads = self.in_flight.values()
        hi, lo = max(loads), min(loads)
        return (hi - lo > self.balance_abs_threshold
                and hi > self.balance_rel_threshold * lo)

    def least_loaded(self) -> Hashable:
        return min(self.workers, key=lambda w: self.in_flight[w])

    def smallest_tree(self) -> Hashable:
        return min(self.workers, key=lambda w: self.tree.sizes[w])

    def best_match(self, token_ids: Sequence[int]) -> tuple[Hashable | None, float]:
        """(worker with the longest cached prefix, its match rate); no side effects."""
        if not token_ids:
            return None, 0.0
        matched, tenants = self.tree.match(token_ids)
        tenants = {w: t for w, t in tenants.items() if w in self.in_flight}
        if matched == 0 or not tenants:
            return None, 0.0
        order = {w: i for i, w in enumerate(self.workers)}
        best = min(tenants, key=lambda w: (-tenants[w], order[w]))
        return best, matched / len(token_ids)

    def choose(self, token_ids: Sequence[int]) -> Hashable:
        """The worker :meth:`route` would pick, without changing any state."""
        if self.is_imbalanced():
            self.last_reason = "imbalanced"
            return self.least_loaded()
        worker, rate = self.best_match(token_ids)
        if worker is not None and rate > self.cache_threshold:
            self.last_reason = "hit"
            return worker
        self.last_reason = "miss"
        if self.miss_policy == "smallest_tree":
            return self.smallest_tree()
        return self.least_loaded()

    # -- state changes ----------------------------------------------------------
    def route(self, request_id: Hashable, token_ids: Sequence[int]) -> Hashable:
        self._flight.check_new(request_id)
        worker = self.choose(token_ids)
        self.tree.insert(token_ids, worker, self.clock())
        self._flight.add(request_id, worker)
        return worker

    def finish(self, request_id: Hashable) -> Hashable:
        return self._flight.finish(request_id)

    def evict(self) -> dict[Hashable, list[tuple[int, ...]]]:
        """Per-worker LRU leaf eviction; returns {worker: evicted prefixes in order}."""
        out = {}
        for w in self.workers:
            if self.tree.sizes[w] > self.max_tree_size:
                out[w] = self.tree.evict_tenant(w, self.max_tree_size)
        return out

    # -- inspection -------------------------------------------------------------
    def tree_size(self, worker: Hashable) -> int:
        return self.tree.sizes[worker]

    def loads(self) -> dict[Hashable, int]:
        return dict(self.in_flight)

    def cached_prefix_len(self, token_ids: Sequence[int], worker: Hashable) -> int:
        return self.tree.match(token_ids, tenant=worker)[0]

    def worker_of(self, request_id: Hashable) -> Hashable:
        return self._flight.worker_of(request_id)

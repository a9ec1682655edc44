"""Purely load-based routing: each request goes to the worker with the fewest requests
in flight (ties: the first in worker order), whatever its cache holds. The routing of a
BanaServe-style global KV store, where any worker can fetch any cached prefix."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from scheduler.baselines.inflight import InFlight


class LeastLoadRouter:
    def __init__(self, workers: Sequence[Hashable]) -> None:
        if not workers:
            raise ValueError("need at least one worker")
        self.workers = list(workers)
        self._flight = InFlight(self.workers)
        self.in_flight = self._flight.counts  # worker -> requests in flight

    def route(self, request_id: Hashable, token_ids: Sequence[int] = ()) -> Hashable:
        self._flight.check_new(request_id)
        worker = min(self.workers, key=lambda w: self.in_flight[w])
        self._flight.add(request_id, worker)
        return worker

    def finish(self, request_id: Hashable) -> Hashable:
        return self._flight.finish(request_id)

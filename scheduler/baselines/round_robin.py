"""Round-robin routing: request k goes to worker k mod N, whatever it holds."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from scheduler.baselines.inflight import InFlight


class RoundRobinRouter:
    def __init__(self, workers: Sequence[Hashable], start: int = 0) -> None:
        if not workers:
            raise ValueError("need at least one worker")
        self.workers = list(workers)
        self._next = start % len(self.workers)
        self._flight = InFlight(self.workers)
        self.in_flight = self._flight.counts  # worker -> requests in flight

    def route(self, request_id: Hashable, token_ids: Sequence[int] = ()) -> Hashable:
        self._flight.check_new(request_id)
        worker = self.workers[self._next]
        self._next = (self._next + 1) % len(self.workers)
        self._flight.add(request_id, worker)
        return worker

    def finish(self, request_id: Hashable) -> Hashable:
        return self._flight.finish(request_id)

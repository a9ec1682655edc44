"""Round-robin routing: request k goes to worker k mod N, whatever it holds."""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class RoundRobinRouter:
    def __init__(self, workers: Sequence[Hashable], start: int = 0) -> None:
        if not workers:
            raise ValueError("need at least one worker")
        self.workers = list(workers)
        self._next = start % len(self.workers)
        self.in_flight: dict[Hashable, int] = dict.fromkeys(self.workers, 0)
        self._assigned: dict[Hashable, Hashable] = {}

    def route(self, request_id: Hashable, token_ids: Sequence[int] = ()) -> Hashable:
        if request_id in self._assigned:
            raise ValueError(f"request {request_id!r} is already in flight")
        worker = self.workers[self._next]
        self._next = (self._next + 1) % len(self.workers)
        self.in_flight[worker] += 1
        self._assigned[request_id] = worker
        return worker

    def finish(self, request_id: Hashable) -> Hashable:
        worker = self._assigned.pop(request_id)
        self.in_flight[worker] -= 1
        return worker

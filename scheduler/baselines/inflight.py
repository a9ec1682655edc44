"""Requests in flight per worker: the load measure the routing baselines share."""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class InFlight:
    """Which worker each in-flight request went to, and how many each worker has."""

    def __init__(self, workers: Sequence[Hashable]) -> None:
        self.counts: dict[Hashable, int] = dict.fromkeys(workers, 0)
        self._assigned: dict[Hashable, Hashable] = {}

    def check_new(self, request_id: Hashable) -> None:
        """Raises ``ValueError`` if ``request_id`` is already in flight."""
        if request_id in self._assigned:
            raise ValueError(f"request {request_id!r} is already in flight")

    def add(self, request_id: Hashable, worker: Hashable) -> None:
        self.check_new(request_id)
        self.counts[worker] += 1
        self._assigned[request_id] = worker

    def finish(self, request_id: Hashable) -> Hashable:
        """Takes a request out; returns the worker it had (``KeyError`` if unknown)."""
        worker = self._assigned.pop(request_id)
        self.counts[worker] -= 1
        return worker

    def worker_of(self, request_id: Hashable) -> Hashable:
        return self._assigned[request_id]

"""The serving loop's reads from the tiers below the pool, in the background.

A waiting request whose prefix is held only in a tier (``MatchResult.tier_keys``) has
its segments promoted before it is scheduled: the control plane takes slots for them
(:meth:`~tokenlake.core.control.ControlPlane.begin_promotion`, under its lock), a
thread of this loop has the transfer engines read the copies into those slots (the
data plane's ``tier_read``, outside the lock), and the next iteration records the
outcome (:meth:`~tokenlake.core.control.ControlPlane.end_promotion`). Meanwhile the
request waits, out of the scheduler's sight, and every other request goes on; a
request that shares a segment being read waits for it as for one another iteration
stores (``SegmentInFlight``). When nothing but reads is left, the loop waits for the
first to end.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)


class TierReads:
    """The promotions of one serving loop (see the module docstring); ``control`` is
    its control plane (or the server's serialised view of it)."""

    def __init__(self, control) -> None:
        self.control = control
        self.promoted = 0  # segments back in a slot
        self._flight: list[tuple[concurrent.futures.Future, object, set[str]]] = []
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None

    def reading(self) -> set[str]:
        """The requests whose segments are being read."""
        return {rid for _, _, rids in self._flight for rid in rids}

    def for_snapshot(self, tracker) -> set[str]:
        """:meth:`step` for the loop's ``tracker`` (a RequestTracker of live records),
        idle when nothing runs; nothing without a tier."""
        if self.control.pool.tier is None or not (self._flight or any(True for _ in tracker.waiting())):
            return set()
        return self.step(list(tracker.waiting()), idle=not any(True for _ in tracker.running()))

    def step(self, waiting: Iterable, idle: bool) -> set[str]:
        """Ends the reads that are over, begins those of ``waiting`` requests (the
        loop's live records) that need some; with ``idle`` (nothing else to compute)
        and only reads left, waits for the first to end. Returns the requests that
        still wait for theirs."""
        self._end(wait=False)
        waiting = list(waiting)
        busy = self.reading()
        # (one whose matched prefix went before its admission computes it all: no read)
        todo = [live for live in waiting if live.request_id not in busy and not live.lost_hit]
        if todo:
            self._begin(todo)
        busy = self.reading()
        if idle and busy and all(live.request_id in busy for live in waiting):
            self._end(wait=True)
        return self.reading()

    def drain(self) -> bool:
        """Waits for the reads in flight and records them (before the loop replaces an
        instance: no read of it may be left to reach its new engine); False if none."""
        had = bool(self._flight)
        while self._flight:
            self._end(wait=True)
        return had

    def close(self) -> None:
        """:meth:`drain`, then stops the reading thread."""
        self.drain()
        if self._threads is not None:
            self._threads.shutdown()
            self._threads = None

    def _begin(self, todo: list) -> None:
        batch = self.control.begin_promotion((live.prompt, live.req.cache_salt) for live in todo)
        if batch is None:
            return
        plane = self.control.tier_data_plane
        if plane is None:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result((set(), {}))  # nothing moves data: read at once
        else:
            if self._threads is None:
                self._threads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tier-read")
            future = self._threads.submit(plane.tier_read, batch.promos)
        self._flight.append((future, batch, {todo[i].request_id for i in batch.prompts}))

    def _end(self, wait: bool) -> None:
        if wait and self._flight:
            concurrent.futures.wait([f for f, _, _ in self._flight],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for entry in [e for e in self._flight if e[0].done()]:
            self._flight.remove(entry)
            future, batch, _ = entry
            try:
                outcome = future.result()
            except Exception as exc:  # noqa: BLE001 - nothing read is trusted
                log.warning("tier reads failed: %s", exc)
                outcome = None
            self.promoted += self.control.end_promotion(batch, outcome)

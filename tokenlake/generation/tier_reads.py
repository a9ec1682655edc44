"""The serving loop's reads from the tiers below the pool, in the background.

A waiting request whose prefix is held only in a tier (``MatchResult.tier_keys``) has
its segments promoted before it is scheduled: the control plane takes slots for them
(:meth:`~tokenlake.core.control.ControlPlane.begin_promotion`, under its lock), a
thread of this loop has the transfer engines read the copies into those slots (the
data plane's ``tier_read``, outside the lock), and a later iteration records the
outcome (:meth:`~tokenlake.core.control.ControlPlane.end_promotion`).

**Overlapped with the request's own iteration.** Reads begun while nothing decodes are
read layer by layer: the transfer engines say when each layer of all their files is in
and checked (``TIER_PROGRESS``), and a :class:`ReadGate` keeps count. Their requests are
scheduled at once, their hit counted (the promoted segments are ready to this loop's
matches and plans only: :func:`~tokenlake.core.tier_flow.readable`), and the compute
engine waits at each layer of an iteration that attends those slots until that layer is
in (``layer_gate``). The promotion ends after that iteration, so no query attends a slot
that a failed read gives back; a read that fails before a layer the iteration needs
fails the iteration (:class:`~tokenlake.core.errors.TierReadFailed`) and its requests are
planned again without the segment. Such an iteration would hold up every request in
it at each layer for the disk, so the overlap is taken only while the requests whose
reads began layer by layer (when nothing ran) are all that is live; until then they
wait as below.

**Otherwise** the request waits, out of the scheduler's sight, and every other request
goes on; a request that shares a segment being read waits for it as for one another
iteration stores (``SegmentInFlight``). When nothing but reads is left, the loop waits
for the first to end.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable

from tokenlake.core.errors import EngineUnavailable, TierReadFailed

log = logging.getLogger(__name__)


class ReadGate:
    """What the layered reads of one promotion batch have brought in: per reading
    instance, how many layers of all its items are in and checked; :meth:`wait` blocks
    until a layer is in, or raises once the reads are over without it."""

    def __init__(self, instances: Iterable[int], layers: int, timeout_s: float | None) -> None:
        self.layers, self.timeout_s = layers, timeout_s
        self._cond = threading.Condition()
        self._in = dict.fromkeys(instances, 0)
        self.over = False
        self.failed = False  # a key did not come back (or the reads raised)
        self.silent = False  # a reader neither answered nor was fenced

    def layer_in(self, instance: int, layers: int) -> None:
        """``instance``'s engine says its first ``layers`` layers are in (the driver's thread)."""
        with self._cond:
            self._in[instance] = max(self._in.get(instance, 0), layers)
            self._cond.notify_all()

    def finish(self, future: concurrent.futures.Future) -> None:
        """The reads are over (``future``: the data plane's ``tier_read``): if every key
        came back, every layer is in (readers that sent no progress too); else what the
        readers said stands."""
        try:
            failed, silent = future.result()
        except BaseException:  # noqa: BLE001 - nothing more is in
            failed, silent = None, {}
        with self._cond:
            if failed is not None and not failed:
                self._in = dict.fromkeys(self._in, self.layers)
            self.over, self.failed, self.silent = True, failed is None or bool(failed), bool(silent)
            self._cond.notify_all()

    def check(self) -> None:
        """Once the reads are over (the driver's deadlines bound them): raises as
        :meth:`wait` would where one failed, even after its last layer came in."""
        with self._cond:
            while not self.over:
                self._cond.wait()
            if self.failed:
                self._raise_over("last", self.silent)

    def wait(self, layer: int) -> None:
        """Returns once ``layer`` of every item is in; raises TierReadFailed once the
        reads are over without it, EngineUnavailable where a reader fell silent (it
        did not answer, or said nothing for ``timeout_s``: the loop replaces it).
        ``timeout_s`` None: reads that report no layers (the driver's deadlines bound
        each of their messages), waited for until they end."""
        with self._cond:
            patience = self.timeout_s
            deadline = None if patience is None else time.monotonic() + patience
            while min(self._in.values(), default=self.layers) <= layer:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0 or self.over:  # (not over: no word for too long)
                    self._raise_over(layer, silent=self.silent or not self.over)
                if self._cond.wait(left) and patience is not None:
                    deadline = time.monotonic() + patience

    @staticmethod
    def _raise_over(layer: int | str, silent: bool) -> None:
        """The reads did not bring ``layer`` in: EngineUnavailable where a reader fell
        ``silent`` (the loop replaces it), else TierReadFailed."""
        if silent:
            raise EngineUnavailable(f"a transfer engine reading a promoted segment fell silent before "
                                    f"its layer {layer}")
        raise TierReadFailed(f"a promoted segment's read failed before its layer {layer} came in")


class TierReads:
    """The promotions of one serving loop (see the module docstring); ``control`` is
    its control plane (or the server's serialised view of it); ``layers`` (the model's)
    and ``timeout_s`` (the longest a gate waits for word of a layer) for overlapped
    reads, which need both and a data plane that reads."""

    def __init__(self, control, layers: int = 0, timeout_s: float = 60.0) -> None:
        self.control, self.layers, self.timeout_s = control, layers, timeout_s
        self.layered = True  # False: every read in the background (the request waits for it whole)
        self.promoted = 0  # segments back in a slot
        self.overlapped = 0  # iterations that attended promotions while they were read
        # (future, batch, request ids, gate: None unless read layer by layer)
        self._flight: list[tuple[concurrent.futures.Future, object, set[str], ReadGate | None]] = []
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._gated: list = []  # the flight entries the iteration now running waits on
        self._overlap = False  # whether the layered reads' requests are the only live ones

    @classmethod
    def of(cls, loop) -> TierReads:
        """The reads of a serving ``loop``: layer by layer where its engine can wait at
        a layer (``layer_gate``), each wait as long as its cluster's requests."""
        layers = loop.cfg.num_layers if hasattr(loop.engine, "layer_gate") else 0
        return cls(loop.control, layers, getattr(loop.cluster, "timeout_s", 60.0))

    def reading(self) -> set[str]:
        """The requests whose segments are being read."""
        return {rid for _, _, rids, _ in self._flight for rid in rids}

    def hidden(self) -> set[str]:
        """The requests kept out of the scheduler's sight: theirs are read in the
        background, or layer by layer while other requests are live."""
        return {rid for _, _, rids, gate in self._flight if gate is None or not self._overlap for rid in rids}

    def promoting(self) -> list:
        """The promotion batches this loop's matches and plans may attend: read layer
        by layer, for the only live requests."""
        return [b for _, b, _, gate in self._flight if gate is not None] if self._overlap else []

    def for_snapshot(self, tracker) -> set[str]:
        """:meth:`step` for the loop's ``tracker`` (a RequestTracker of live records),
        idle when nothing runs; returns :meth:`hidden` (the layered reads' requests are
        shown only when they are all that is live). Nothing without a tier."""
        if self.control.pool.tier is None or not (self._flight or any(True for _ in tracker.waiting())):
            return set()
        self.step(list(tracker.waiting()), idle=not any(True for _ in tracker.running()))
        return self.hidden()

    def match(self, tree, live):
        """``live``'s match for the snapshot (the promotions it may attend counted)."""
        promoting = self.promoting()
        if promoting:
            return self.control.match_promoting(live.prompt, len(live.prompt) - 1, live.req.cache_salt, promoting)
        return tree.match(live.prompt, max_tokens=len(live.prompt) - 1, salt=live.req.cache_salt)

    def step(self, waiting: Iterable, idle: bool) -> set[str]:
        """Ends the reads that are over, begins those of ``waiting`` requests (the
        loop's live records) that need some (layer by layer when ``idle``: nothing
        else runs); with ``idle`` and only background reads left, waits for the first
        to end. Returns the requests that still wait for theirs."""
        self._end(wait=False)
        waiting = list(waiting)
        busy = self.reading()
        # (one whose matched prefix went before its admission computes it all: no read)
        todo = [live for live in waiting if live.request_id not in busy and not live.lost_hit]
        if todo:
            self._begin(todo, layered=idle)
        self._overlap_if(idle, waiting)
        hidden = self.hidden()
        if idle and hidden and all(live.request_id in hidden for live in waiting):
            self._end(wait=True)
            self._overlap_if(idle, waiting)
        return self.reading()

    def _overlap_if(self, idle: bool, waiting: list) -> None:
        """Overlap while nothing runs and every waiting request's read is layered."""
        layered = {rid for _, _, rids, gate in self._flight if gate is not None for rid in rids}
        self._overlap = idle and bool(layered) and all(live.request_id in layered for live in waiting)

    def compute(self, engine, plans, batches, take_back):
        """The iteration of ``plans`` computed (:meth:`run`) and completed, the reads it
        attended ended (:meth:`settle`); if it fails, its plans are aborted and
        ``take_back()`` called, then None is returned where a tier read it attended
        failed (``TierReadFailed``: its requests are planned again without the segment),
        and anything else raised."""
        try:
            out = self.run(engine, plans, batches)
            self._check_gated()  # (before its new segments are published under the promoted ones)
        except BaseException as exc:
            self.control.abort(plans)
            take_back()
            self.settle()
            if isinstance(exc, TierReadFailed):
                return None
            raise
        self.control.complete(plans)
        self.settle()
        return out

    def run(self, engine, plans, batches):
        """``engine.run(plans, batches)``, its layers gated on the layered reads whose
        slots ``plans`` attend or copy from; :meth:`settle` ends those reads after it."""
        layered = [e for e in self._flight if e[3] is not None]
        slots = _slots_of(plans) if layered else set()  # (nothing to look for: most iterations)
        self._gated = [e for e in layered if any((p.to, p.slot) in slots for p in e[1].promos)]
        if not self._gated:
            return engine.run(plans, batches)
        gates = [e[3] for e in self._gated]
        self.overlapped += 1
        engine.layer_gate = lambda layer: [g.wait(layer) for g in gates]
        try:
            return engine.run(plans, batches)
        finally:
            engine.layer_gate = None

    def _check_gated(self) -> None:
        """Waits for the reads the iteration attended to end (every layer was reported:
        their answers are on the way). Raises if one failed anyway (after its last
        report: the file was longer than its header said, or its engine went silent):
        its promotion would take the segment, and what the iteration stored under it,
        out of the tree, while the request went on holding them."""
        for entry in self._gated:
            entry[3].check()

    def settle(self) -> None:
        """Ends the reads the last :meth:`run` waited on (after its iteration completed
        or was aborted): their segments are ready, or gone if a read failed."""
        gated, self._gated = self._gated, []
        if gated:
            concurrent.futures.wait([e[0] for e in gated])
            self._end(wait=False)

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

    def _begin(self, todo: list, layered: bool) -> None:
        batch = self.control.begin_promotion((live.prompt, live.req.cache_salt) for live in todo)
        if batch is None:
            return
        plane, gate = self.control.tier_data_plane, None
        if plane is None:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result((set(), {}))  # nothing moves data: read at once
        else:
            if self._threads is None:
                self._threads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tier-read")
            if layered and self.layers and self.layered:
                reports = getattr(plane, "reads_layered", lambda: False)()  # else no word until the end
                gate = ReadGate({p.instance for p in batch.promos}, self.layers, self.timeout_s if reports else None)
                future = self._threads.submit(plane.tier_read, batch.promos, on_layer=gate.layer_in)
                future.add_done_callback(gate.finish)
            else:
                future = self._threads.submit(plane.tier_read, batch.promos)
        self._flight.append((future, batch, {todo[i].request_id for i in batch.prompts}, gate))

    def _end(self, wait: bool) -> None:
        if wait and self._flight:
            concurrent.futures.wait([e[0] for e in self._flight],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for entry in [e for e in self._flight if e[0].done()]:
            self._flight.remove(entry)
            future, batch = entry[0], entry[1]
            try:
                outcome = future.result()
            except Exception as exc:  # noqa: BLE001 - nothing read is trusted
                log.warning("tier reads failed: %s", exc)
                outcome = None
            self.promoted += self.control.end_promotion(batch, outcome)


def _slots_of(plans) -> set[tuple[int, int]]:
    """The ``(instance, slot)`` s an iteration's ``plans`` attend or copy pages from."""
    out = {(task.instance, slot) for qp in plans.query_plans for task in qp.tasks + qp.tails
           for item in task.items for slot in item.slots}
    out.update((c.src_instance, c.src_slot) for tp in plans.transfer_plans for c in tp.copies)
    return out

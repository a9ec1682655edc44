"""A transfer engine's tier requests (``TIER_OPS``, ``TIER_READ``, ``TIER_LIST``:
:mod:`tokenlake.dataplane.messages.tier`), served beside its puts.

:class:`TierServing` is the part of :class:`~tokenlake.engines.transfer.TransferEngine`
that opens the instance's tier (:mod:`tokenlake.engines.tier_store`: a directory, or
host memory) and answers the driver. A read from a disk tier runs on a thread of its
own (:class:`OffLoop`): the engine's loop goes on serving puts, peers and its sessions'
doorbells meanwhile, instead of stalling them for the whole read (tens of milliseconds
a segment, more on a slow disk), and answers the read once it is over. A read from
host memory is a copy and is served at once.

Tier requests are served in the order they came, with one exception: while a read is
in flight, the ``TIER_OPS`` and ``TIER_LIST`` behind it are served at once as long as
none is a fence (a ``TIER_OPS`` of a higher epoch than the read's), drops a copy the
read has still to read, or is another read. They touch no slot the read writes (the
control plane stages other segments), and a control plane call that queued tier work
(a put's write-through, an eviction's drops) so no longer waits for another request's
read. The others, and everything after them, wait until the read is over: once a fence
is answered no older read writes a slot, and a copy being read is not dropped under it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
from collections.abc import Callable

from tokenlake.core.errors import PlanError
from tokenlake.dataplane.messages import (
    TierDone,
    TierEntry,
    TierList,
    TierListing,
    TierOps,
    TierProgress,
    TierRead,
)
from tokenlake.engines.tier_store import HostTier, TierStore, slot_bytes

log = logging.getLogger(__name__)

TierRequest = TierOps | TierRead | TierList


class OffLoop:
    """Work for one thread beside an engine's loop: :meth:`submit` runs ``fn`` there
    and ``then(future)`` back on the loop's thread, once the loop polls :attr:`fd`
    readable and calls :meth:`drain`."""

    def __init__(self, name: str) -> None:
        self.fd, self._wake = os.pipe()
        os.set_blocking(self.fd, False)
        self._threads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._done: collections.deque = collections.deque()

    def submit(self, fn: Callable[[], object], then: Callable[[concurrent.futures.Future], None]) -> None:
        self._threads.submit(fn).add_done_callback(lambda future: self._ring(then, future))

    def post(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` on the loop's thread (from the worker: in order with its jobs'
        ``then``, which come after what the job posted)."""
        self._ring(lambda _future: fn(), None)

    def _ring(self, then: Callable, future: concurrent.futures.Future | None) -> None:
        """Queues ``then(future)`` for the loop's thread and wakes it."""
        self._done.append((then, future))
        try:
            os.write(self._wake, b"\0")
        except OSError:  # closed: the engine is stopping
            pass

    def drain(self) -> None:
        """Runs the ``then`` of every job that ended (on the loop's thread)."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass
        while self._done:
            then, future = self._done.popleft()
            then(future)

    def close(self) -> None:
        """Waits for the job in flight, then closes the wake-up pipe (once)."""
        self._threads.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self._wake)
            os.close(self.fd)
            self.fd = self._wake = -1


class TierServing:
    """The tier of a transfer engine (a mixin of it: it provides ``spec``, ``slab``,
    ``shared``, ``num_slots``, ``num_layers``, ``reply``, ``refuse`` and ``add_waker``)."""

    def _init_tier(self) -> None:
        spec = self.spec
        self.tier: TierStore | HostTier | None = None
        self.tier_epoch = 0  # the highest epoch of a tier message seen (TierOps: the fence)
        self.tier_answers = 0  # TIER_DONEs sent (their counters' order)
        self._tier_queue: collections.deque = collections.deque()  # (identity, msg id, request)
        self._reading: TierRead | None = None  # the read in flight on the reader's thread
        self._reader: OffLoop | None = None
        if spec.tier_path is not None:
            layout = {"segment": list(self.slab.shape[1:]), "dtype": str(self.slab.dtype)}
            self.tier = TierStore(spec.tier_path, spec.tier_bytes, layout, fsync=spec.tier_fsync,
                                  write_bw=spec.tier_write_bw,  # a digest per layer
                                  chunk_bytes=slot_bytes(self.slab, 0).numel() // self.num_layers)
            self._reader = OffLoop(f"tier-read-{spec.instance}")
            self.add_waker(self._reader.fd, self._reader.drain)
        elif spec.tier_bytes:
            self.tier = HostTier(spec.tier_bytes, slot_bytes(self.slab, 0).numel(),
                                 pin=self.slab.device.type == "cuda")

    def tier_request(self, identity, msg_id: int, message: TierRequest) -> None:
        """Serves ``message`` once every tier request before it is answered."""
        self._tier_queue.append((identity, msg_id, message))
        self._tier_next()

    def _tier_next(self) -> None:
        while self._tier_queue:
            identity, msg_id, message = self._tier_queue[0]
            reading = self._reading
            if reading is not None and (isinstance(message, TierRead) or isinstance(message, TierOps) and (
                    message.epoch > reading.epoch or any(it[0] in message.drops for it in reading.items))):
                return  # another read, a fence, a drop of what is read: after it (and what follows too)
            self._tier_queue.popleft()
            try:
                refused = self._tier_check(message)
                if refused is not None or not isinstance(message, TierRead):
                    self.reply(identity, (refused or self._tier(message)).encode(msg_id))
                elif self._reader is not None:
                    self._read_off_loop(identity, msg_id, message)
                else:
                    self.reply(identity, self._tier_done(self._read_items(message)).encode(msg_id))
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                self.refuse(identity, msg_id, exc)

    def _tier_check(self, message: TierRequest) -> TierDone | None:
        """Raises on a request this engine cannot serve; a fenced-off one's answer (all
        of it failed), or None to serve it."""
        if self.tier is None:
            raise PlanError(f"instance {self.spec.instance} has no tier")
        if isinstance(message, TierList):
            return None
        reading = isinstance(message, TierRead)
        slots = [it[1] for it in message.items] if reading else [s for s, _e in message.writes]
        if any(not 0 <= slot < self.num_slots for slot in slots):
            raise PlanError(f"slot out of range [0, {self.num_slots})")
        if message.epoch < self.tier_epoch:  # the driver gave up on it: its slots may be others' now
            log.warning("instance %d: a tier message of epoch %d refused (fenced at %d)",
                        self.spec.instance, message.epoch, self.tier_epoch)
            return TierDone((), tuple(it[0] for it in message.items) if reading
                            else tuple(e.key for _s, e in message.writes), self._tier_counters())
        self.tier_epoch = message.epoch
        return None

    def _tier(self, message: TierOps | TierList) -> TierDone | TierListing:
        tier = self.tier
        if isinstance(message, TierList):
            return TierListing(tuple(TierEntry(k, *meta) for k, meta in tier.listing()
                                     if isinstance(meta, list) and len(meta) == 3))
        done, failed = [], []
        for key in message.drops:
            tier.drop(key)
        for slot, e in message.writes:
            staged = tier.stage(e.key, slot_bytes(self.slab, slot), [e.parent, e.index, e.tokens])
            (done if staged else failed).append(e.key)
        return TierDone(tuple(done), tuple(failed), self._tier_counters())

    def _read_items(self, message: TierRead, on_layer: Callable[[int], None] | None = None) -> list[tuple[bytes, bool]]:
        """Reads each item's copy into its slot: ``(key, whether it came back intact)``;
        with ``on_layer``, layer by layer where the tier can (``on_layer(n)``: the first
        ``n`` layers of every item are in)."""
        slabs = [self.slab if target in (-1, self.spec.instance) else self.shared.get(target)
                 for _key, _slot, target in message.items]
        if on_layer is not None and hasattr(self.tier, "read_layers_into") and all(s is not None for s in slabs):
            ok = self.tier.read_layers_into([(key, slot_bytes(slab, slot)) for (key, slot, _t), slab
                                             in zip(message.items, slabs)], self.num_layers, on_layer)
            return [(item[0], good) for item, good in zip(message.items, ok)]
        return [(key, slab is not None and self.tier.read_into(key, slot_bytes(slab, slot)))
                for (key, slot, _target), slab in zip(message.items, slabs)]

    def _read_off_loop(self, identity, msg_id: int, message: TierRead) -> None:
        def then(future: concurrent.futures.Future) -> None:
            self._reading = None
            try:
                self.reply(identity, self._tier_done(future.result()).encode(msg_id))
            except Exception as exc:  # noqa: BLE001 - as a refused request
                self.refuse(identity, msg_id, exc)
            self._tier_next()

        def progress(layers: int) -> None:  # on the reader's thread: sent from the loop's
            self._reader.post(lambda: self.reply(identity, TierProgress(layers).encode(msg_id)))

        on_layer = progress if message.layered else None
        self._reader.submit(lambda: self._read_items(message, on_layer), then)  # (may raise: then not reading)
        self._reading = message

    def _tier_done(self, outcome: list[tuple[bytes, bool]]) -> TierDone:
        return TierDone(tuple(k for k, ok in outcome if ok), tuple(k for k, ok in outcome if not ok),
                        self._tier_counters())

    def _tier_counters(self) -> dict[str, float]:
        """The tier's counters for a ``TIER_DONE``, numbered (``answers``): answers that
        reach the driver by several sockets, the newest is told apart."""
        self.tier_answers += 1
        return {**self.tier.counters(), "answers": float(self.tier_answers)}

    def close_tier(self) -> None:
        """Waits for a read in flight (unanswered: the engine is stopping), then closes
        the tier (what was staged is written first)."""
        if self._reader is not None:
            self._reader.close()
        if self.tier is not None:
            self.tier.close()

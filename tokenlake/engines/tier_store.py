"""A transfer engine's tier at work: slots staged, written in the background, read back
on a promotion (``TIER_OPS``, ``TIER_READ``: :mod:`tokenlake.dataplane.messages.tier`).
:class:`TierStore` is a disk tier, :class:`HostTier` one in host memory.

Staging copies a slot's bytes (all its layers, one contiguous block of the slab) into
memory before the engine answers, so the control plane may reuse the slot at once; a
writer thread then writes them to the tier's file (:class:`~tokenlake.engines.tier_files.TierFiles`:
a temporary file, flushed, renamed). A read finds a segment still waiting to be written
in memory, else reads its file, whose digest is checked. Drops and writes run in the
order they came: a drop of a key removes whatever was staged for it before, and a later
write of the same key stands. Staged bytes are bounded (``staging_bytes``): a write
that does not fit is refused, and the control plane forgets that copy.

The writer's bandwidth is bounded (``write_bw`` bytes a second, :class:`Pacer`): after
each file it waits until its bytes fit the rate, so write-through never takes more of
the disk than that, whatever the pool stores; what comes faster waits staged, and what
does not fit the staging memory has no copy. Closing waits for the staged writes at
full speed (a clean stop keeps what was written through), then releases the directory.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import torch

from tokenlake.core.errors import TierCorrupt
from tokenlake.dataplane.messages.tier import TIER_COUNTERS
from tokenlake.engines.tier_files import CHUNK_BYTES, TierFiles

log = logging.getLogger(__name__)

#: Bytes of segments staged and not yet written, at most (then writes are refused).
DEFAULT_STAGING_BYTES = 256 << 20


#: The disk tier's write bandwidth by default, bytes a second (``ClusterConfig.tier_write_bw``).
DEFAULT_WRITE_BW = 1 << 30


class Pacer:
    """Bounds a stream of writes to ``rate`` bytes a second (``0``: unbounded):
    :meth:`delay` after each write says how long to wait before the next (the write's
    own time counts). A writer idle for a while does not save up: at most ``burst_s``
    of the rate is carried over. ``clock``: seconds, monotonic."""

    def __init__(self, rate: float, burst_s: float = 0.05, clock=time.monotonic) -> None:
        self.rate, self.burst_s, self.clock = rate, burst_s, clock
        self._due = clock()  # when the bytes written so far fit the rate

    def delay(self, nbytes: int, began: float) -> float:
        """Seconds to wait after a write of ``nbytes`` that began at ``began`` (this
        clock's time; 0 when within the rate)."""
        if self.rate <= 0:
            return 0.0
        self._due = max(self._due, began - self.burst_s) + nbytes / self.rate
        return max(0.0, self._due - self.clock())


def slot_bytes(slab: torch.Tensor, slot: int) -> torch.Tensor:
    """Slot ``slot`` of ``slab`` (all layers) as a flat uint8 view of the same memory."""
    return slab[slot].reshape(-1).view(torch.uint8)


class TierStore:
    """One instance's disk tier as its transfer engine uses it (see the module docstring).

    ``path``: this instance's tier directory; ``capacity_bytes``: what its files may
    take; ``layout``: what identifies the slab's format (files of another are not
    adopted); ``write_bw``: the writer's bytes a second (0: unbounded; or a
    :class:`Pacer`); ``chunk_bytes``: what each digest of a file covers (the engine
    gives one layer of a slot)."""

    def __init__(self, path: str | Path, capacity_bytes: int, layout: dict[str, Any],
                 staging_bytes: int = DEFAULT_STAGING_BYTES, fsync: bool = True,
                 write_bw: float | Pacer = DEFAULT_WRITE_BW, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.files = TierFiles(path, capacity_bytes, layout, fsync=fsync, chunk_bytes=chunk_bytes)
        self.staging_bytes = staging_bytes
        self.pacer = write_bw if isinstance(write_bw, Pacer) else Pacer(write_bw)
        # key -> (its bytes, its meta), until written; a write job holds the same tuple
        self._staged: dict[bytes, tuple[bytes, Any]] = {}
        self._staged_bytes = 0
        self._jobs: deque[tuple[str, bytes, tuple[bytes, Any] | None]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self.written = self.write_errors = self.refused = self.reads = self.read_failures = 0
        self.paced_s = 0.0  # the writer's waits on the bandwidth limit
        self._thread = threading.Thread(target=self._run, name="tier-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ requests
    def drop(self, key: bytes) -> None:
        with self._cond:
            self._unstage(key)
            self._jobs.append(("drop", key, None))
            self._cond.notify()

    def stage(self, key: bytes, view: torch.Tensor, meta: Any = None) -> bool:
        """Copies ``view`` (a slot's bytes: :func:`slot_bytes`) to be written as
        ``key``, with ``meta`` in its file's header (:meth:`listing` gives it back);
        False (nothing copied) when the staging memory is full."""
        n = view.numel()
        with self._cond:
            if self._staged_bytes + n > self.staging_bytes:
                self.refused += 1
                return False
        data = view.cpu().numpy().tobytes()  # only this thread stages: the room is still there
        with self._cond:
            self._unstage(key)
            entry = self._staged[key] = (data, meta)
            self._staged_bytes += n
            self._jobs.append(("write", key, entry))
            self._cond.notify()
        return True

    def read_into(self, key: bytes, out: torch.Tensor) -> bool:
        """Writes segment ``key``'s bytes into ``out`` (:func:`slot_bytes`: a slot taken
        for this read); False if the tier does not hold it whole and intact (``out``'s
        bytes are then not to be used). A file is read straight into a slot in host
        memory, its digest checked as it arrives."""
        with self._cond:
            entry = self._staged.get(key)
        try:
            if entry is not None:
                _copy_in(entry[0], out)
            elif out.device.type == "cpu":
                self.files.get_into(key, out.numpy())
            else:  # a GPU slot: through host memory
                _copy_in(self.files.get(key), out)
        except (KeyError, TierCorrupt, ValueError) as exc:
            log.warning("tier read of %s failed: %s", key.hex(), exc)
            self.read_failures += 1
            return False
        self.reads += 1
        return True

    def read_layers_into(self, items: list[tuple[bytes, torch.Tensor]], layers: int,
                         on_layer: Callable[[int], None]) -> list[bool]:
        """:meth:`read_into` of several segments (``(key, slot bytes)``), a layer at a
        time (:meth:`TierFiles.get_layers_into`): ``on_layer(n)`` at each layer, ``n`` the
        layers of every one in and checked so far. A copy still staged, or one for a GPU
        slot, is read whole first; after a failure ``n`` stays as it was."""
        ok = [True] * len(items)
        files = []
        for i, (key, out) in enumerate(items):
            with self._cond:
                staged = key in self._staged
            if staged or out.device.type != "cpu":
                ok[i] = self.read_into(key, out)
            else:
                files.append(i)
        if not all(ok):  # no layer of every segment will be in: 0, as the driver's clock
            on_layer = functools.partial(_none_in, on_layer)
        got = self.files.get_layers_into([(items[i][0], items[i][1].numpy()) for i in files], layers,
                                         on_layer) if files else []
        for i, good in zip(files, got):
            ok[i] = good
            if good:
                self.reads += 1
            else:
                self.read_failures += 1
        return ok

    def listing(self) -> list[tuple[bytes, Any]]:
        """``(key, meta)`` of every segment held, least recently used first (the staged
        ones last)."""
        with self._cond:
            staged = [(k, meta) for k, (_data, meta) in self._staged.items()]
        mine = {k for k, _ in staged}  # the same snapshot: a write finishing now is listed once
        held = [(k, self.files.meta(k)) for k in self.files.keys() if k not in mine]
        return held + staged

    def close(self) -> None:
        """Writes what is staged, stops the writer and releases the directory."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        self.files.close()

    @property
    def staged_bytes(self) -> int:
        return self._staged_bytes

    def counters(self) -> dict[str, float]:
        """The :data:`~tokenlake.dataplane.messages.tier.TIER_COUNTERS` as they stand."""
        return _counters(self)

    # -------------------------------------------------------------- writer
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return
                op, key, entry = self._jobs.popleft()
                if op == "write" and self._staged.get(key) is not entry:
                    continue  # dropped, or staged again since: that write stands
            began = self.pacer.clock()
            try:
                if op == "drop":
                    self.files.remove(key)
                else:
                    self.files.put(key, *entry)
                    self.written += 1
            except Exception as exc:  # noqa: BLE001 - a failed write is a miss later, not a crash
                self.write_errors += 1
                log.warning("tier %s of %s failed: %s", op, key.hex(), exc)
            if op == "write":
                with self._cond:
                    if self._staged.get(key) is entry:
                        self._unstage(key)
                    self._pace(len(entry[0]), began)

    def _pace(self, nbytes: int, began: float) -> None:
        """Waits (under the lock, which the wait releases) until a write of ``nbytes``
        that began at ``began`` fits the write rate; at once when closing."""
        start = time.monotonic()
        deadline = start + self.pacer.delay(nbytes, began)
        while not self._closing and (wait := deadline - time.monotonic()) > 0:
            self._cond.wait(wait)
        self.paced_s += time.monotonic() - start

    def _unstage(self, key: bytes) -> None:
        """Forgets what is staged for ``key`` (under the lock)."""
        entry = self._staged.pop(key, None)
        if entry is not None:
            self._staged_bytes -= len(entry[0])


def _none_in(on_layer: Callable[[int], None], _layers: int) -> None:
    """What a layered read tells once a segment has failed: no layer of all is in (but
    the read goes on: the driver waits for the answer)."""
    on_layer(0)


def _copy_in(data: bytes, out: torch.Tensor) -> None:
    """``data`` (a segment's bytes) into ``out``; ValueError if the lengths differ."""
    if len(data) != out.numel():
        raise ValueError(f"{len(data)} bytes for a slot of {out.numel()}")
    if out.device.type == "cpu":
        out.numpy()[:] = numpy.frombuffer(data, dtype=numpy.uint8)
    else:  # a file's bytes come as a bytearray already: wrapped, not copied again
        out.copy_(torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8))


class HostTier:
    """One instance's tier in host memory (``EngineSpec.tier_path`` ``None``): the copies
    lie in one buffer of ``capacity_bytes // slot_nbytes`` slots (pinned when ``pin``:
    a GPU slab copies to and from it by DMA), allocated once; a copy is taken before the
    engine answers and read back from there. What :class:`TierStore` offers, less the
    files: nothing survives the engine.

    The control plane never asks for more copies than fit (its ``tier_slots`` are this
    buffer's slots); a write beyond them is refused all the same."""

    def __init__(self, capacity_bytes: int, slot_nbytes: int, pin: bool = False) -> None:
        self.capacity = capacity_bytes // slot_nbytes
        self.slot_nbytes = slot_nbytes
        self._buf = torch.empty((self.capacity, slot_nbytes), dtype=torch.uint8, pin_memory=pin)
        self._free = list(range(self.capacity - 1, -1, -1))
        # key -> (its row of the buffer, its meta), least recently written or read first
        self._held: OrderedDict[bytes, tuple[int, Any]] = OrderedDict()
        self.written = self.write_errors = self.refused = self.reads = self.read_failures = 0
        self.staged_bytes = 0  # nothing waits to be written
        self.paced_s = 0.0  # nor at a bandwidth limit

    def drop(self, key: bytes) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._free.append(held[0])

    def stage(self, key: bytes, view: torch.Tensor, meta: Any = None) -> bool:
        """Copies ``view`` (:func:`slot_bytes`) as ``key``; False when no row is free or
        ``view`` is not one slot."""
        held = self._held.pop(key, None)
        row = held[0] if held is not None else (self._free.pop() if self._free else None)
        if row is None or view.numel() != self.slot_nbytes:
            if row is not None:
                self._free.append(row)
                self.write_errors += 1  # not a slot's bytes
            else:
                self.refused += 1  # no row free
            return False
        self._buf[row].copy_(view)
        self._held[key] = (row, meta)
        self.written += 1
        return True

    def read_into(self, key: bytes, out: torch.Tensor) -> bool:
        held = self._held.get(key)
        if held is None or out.numel() != self.slot_nbytes:
            self.read_failures += 1
            return False
        out.copy_(self._buf[held[0]])
        self._held.move_to_end(key)
        self.reads += 1
        return True

    def listing(self) -> list[tuple[bytes, Any]]:
        """``(key, meta)`` of every copy, least recently used first."""
        return [(k, meta) for k, (_row, meta) in self._held.items()]

    def counters(self) -> dict[str, float]:
        """As :meth:`TierStore.counters`."""
        return _counters(self)

    def close(self) -> None:
        self._held.clear()
        self._buf = torch.empty(0, dtype=torch.uint8)


def _counters(tier: TierStore | HostTier) -> dict[str, float]:
    return {name: float(getattr(tier, name)) for name in TIER_COUNTERS if hasattr(tier, name)}

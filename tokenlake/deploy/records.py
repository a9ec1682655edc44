"""The slot records of each instance, in a shared table beside its slab (docs/design.md
§4 "Restart"): the :class:`~tokenlake.core.slot_records.SlotJournal` of a launcher's
control plane.

Each instance has a ``records`` buffer (:class:`~tokenlake.deploy.base.BufferLayout`): one
fixed-size record per slot, written by the control process (the owner, which made the
buffer) whenever the tree seals, reads or drops a ready replica, and read back by a new
control process that adopts the pool after the first one died. The buffer is shared
memory, so it outlives the process that wrote it exactly as long as the slab does.

A record (little-endian, :data:`HEADER` then ``C`` int32 token ids)::

    state u4      SEALED, or 0 (the slot holds no ready replica)
    index u4      the segment's position in its sequence
    ntokens i4    token ids recorded (-1: none)
    flags u4      bit 0: the parent is a root (no parent key)
    key, parent, namespace  16 bytes each (namespace: the pool's root key)
    access f8     last read, wall-clock seconds
    digest 16 bytes   blake2b of everything above but state and access, and the tokens

Sealing writes the state last, clearing writes it first: a record torn by a crash is
either clear or fails its digest, and a slot is written only by the one control process,
never while an engine could still be storing into it (a pending replica has no record).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable

import numpy as np

from tokenlake.core.segments import KEY_BYTES, SegmentKey
from tokenlake.core.slot_records import SlotRecord

log = logging.getLogger(__name__)

SEALED = 0x314C5354  # "TSL1"
_PARENT_IS_ROOT = 1
HEADER = np.dtype([
    ("state", "<u4"), ("index", "<u4"), ("ntokens", "<i4"), ("flags", "<u4"),
    ("key", "V16"), ("parent", "V16"), ("namespace", "V16"),
    ("access", "<f8"), ("digest", "V16"), ("pad", "V8"),
])  # fmt: skip
_DIGEST_AT = HEADER.fields["digest"][1]
_ACCESS_AT = HEADER.fields["access"][1]


def record_bytes(segment_tokens: int) -> int:
    """Bytes of one slot's record."""
    return HEADER.itemsize + 4 * segment_tokens


def _digest(rec: np.ndarray, tokens: np.ndarray) -> bytes:
    raw = rec.tobytes()
    h = hashlib.blake2b(raw[4:_ACCESS_AT], digest_size=16, person=b"tokenlake-slot")
    h.update(tokens.tobytes())
    return h.digest()


class RecordTables:
    """Every instance's record table (a ``[slots, record_bytes]`` uint8 array, attached
    with :meth:`attach`); times are converted between the pool's ``clock`` and the wall
    clock, so records outlive the process whose monotonic clock wrote them."""

    def __init__(self, segment_tokens: int, namespace_root: SegmentKey,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.c = segment_tokens
        self.root = namespace_root
        self.clock, self.wall = clock, wall
        self.dtype = np.dtype([("h", HEADER), ("tokens", "<i4", (segment_tokens,))])
        self._tables: dict[int, np.ndarray] = {}

    def attach(self, instance: int, table) -> None:
        """Keeps ``instance``'s records in ``table`` (a ``[slots, record_bytes]`` uint8
        array or tensor, shared memory)."""
        arr = table.numpy() if hasattr(table, "numpy") else np.asarray(table)
        if arr.ndim != 2 or arr.shape[1] != self.dtype.itemsize or arr.dtype != np.uint8:
            raise ValueError(f"a record table is [slots, {self.dtype.itemsize}] uint8, got "
                             f"{arr.dtype} {tuple(arr.shape)}")
        self._tables[instance] = arr.view(self.dtype).reshape(arr.shape[0])

    def detach(self, instance: int) -> None:
        self._tables.pop(instance, None)

    def clear_all(self, instance: int) -> None:
        """Every slot of ``instance`` empty (a restarted, empty instance)."""
        table = self._tables.get(instance)
        if table is not None:
            table["h"]["state"] = 0

    # ------------------------------------------------------------ the journal
    def sealed(self, instance: int, slot: int, key: SegmentKey, parent: SegmentKey | None,
               index: int, tokens: bytes | None, last_access: float) -> None:
        table = self._tables.get(instance)
        if table is None:
            return
        rec = table[slot:slot + 1]
        h = rec["h"]
        h["state"] = 0  # torn from here until the last line: clear
        h["index"] = index
        h["flags"] = _PARENT_IS_ROOT if parent is None else 0
        h["key"] = np.void(key)
        h["parent"] = np.void(parent or bytes(KEY_BYTES))
        h["namespace"] = np.void(self.root)
        h["access"] = self._wall(last_access)
        toks = rec["tokens"][0]
        if tokens is None:
            h["ntokens"] = -1
            toks[:] = 0
        else:
            ids = np.frombuffer(tokens, dtype="<i4")
            h["ntokens"] = len(ids)
            toks[:len(ids)] = ids
            toks[len(ids):] = 0
        h["digest"] = np.void(_digest(h[0], toks))
        h["state"] = SEALED

    def touched(self, instance: int, slot: int, last_access: float) -> None:
        table = self._tables.get(instance)
        if table is not None:
            table["h"]["access"][slot] = self._wall(last_access)

    def cleared(self, instance: int, slot: int) -> None:
        table = self._tables.get(instance)
        if table is not None:
            table["h"]["state"][slot] = 0

    # ------------------------------------------------------------ reading back
    def read(self, instance: int) -> tuple[list[SlotRecord], list[int]]:
        """``(records, torn)``: the sealed records of ``instance`` whose digest holds and
        that belong to this pool's namespace (times in the pool's clock), and the slots
        whose record is sealed but does not check out (cleared here)."""
        table = self._tables[instance]
        out, torn = [], []
        offset = self.wall() - self.clock()
        for slot in np.flatnonzero(table["h"]["state"] == SEALED):
            h, toks = table["h"][slot], table["tokens"][slot]
            n = int(h["ntokens"])
            if (bytes(h["digest"]) != _digest(h, toks) or bytes(h["namespace"]) != self.root
                    or not -1 <= n <= self.c or n == 0):
                torn.append(int(slot))
                table["h"]["state"][slot] = 0
                continue
            parent = None if int(h["flags"]) & _PARENT_IS_ROOT else bytes(h["parent"])
            out.append(SlotRecord(instance, int(slot), bytes(h["key"]), parent, int(h["index"]),
                                  None if n < 0 else toks[:n].tobytes(),
                                  float(h["access"]) - offset))
        return out, torn

    def _wall(self, t: float) -> float:
        return t + (self.wall() - self.clock())

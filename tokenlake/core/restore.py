"""A pool rebuilt from its slots' records (docs/design.md §4 "Restart"): the tree,
replicas and LRU order a new control process adopts (records:
:mod:`tokenlake.core.slot_records`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tokenlake.core.errors import SegmentNotFound
from tokenlake.core.pool import CachePool
from tokenlake.core.segments import KEY_BYTES
from tokenlake.core.slot_records import SlotRecord


@dataclass
class RestoreReport:
    """What :func:`restore` made of the records: per instance, the replicas adopted; the
    records refused (``(instance, slot, why)``)."""

    restored: dict[int, int] = field(default_factory=dict)
    refused: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def segments(self) -> int:
        return sum(self.restored.values())


def record_key_ok(pool: CachePool, rec: SlotRecord) -> bool:
    """Whether ``rec``'s key is what its parent and tokens hash to (a whole segment's
    chained key or a tail's); a record without tokens cannot be checked (True)."""
    if rec.tokens is None:
        return True
    hasher, c = pool.hasher, pool.config.segment_tokens
    n = len(rec.tokens) // 4
    if len(rec.tokens) % 4 or not 0 < n <= c:
        return False
    if n == c:
        return next(hasher.iter_keys(rec.tokens, rec.parent), None) == rec.key
    return hasher.tail_key(rec.tokens, rec.parent) == rec.key


def restore(pool: CachePool, records: Iterable[SlotRecord],
            on_refused: Callable[[SlotRecord, str], None] = lambda rec, why: None) -> RestoreReport:
    """Rebuilds an empty ``pool``'s tree, replicas and LRU order from ``records``:
    every record whose key checks out, whose parent is restored (or that starts a
    sequence), on an instance of the pool and a free slot, becomes a ready replica at
    its recorded access time. Parents go first (by index); a record that cannot be
    adopted is reported to ``on_refused`` (the caller clears it) and skipped, with
    every record that hangs under it."""
    if len(pool.tree):
        raise ValueError("restore needs an empty pool")
    report = RestoreReport()
    tree, slots = pool.tree, pool.slots
    capacity = {i: slots.capacity(i) for i in pool.instances}

    def refuse(rec: SlotRecord, why: str) -> None:
        report.refused.append((rec.instance, rec.slot, why))
        on_refused(rec, why)

    taken: set[tuple[int, int]] = set()
    for rec in sorted(records, key=lambda r: (r.index, r.last_access)):
        why = _fault(pool, rec, capacity, taken)
        if why is None and rec.key not in tree:
            try:
                tree.insert(rec.key, rec.parent, rec.index, rec.tokens)
            except (ValueError, SegmentNotFound) as exc:  # parent not adopted, or not a root
                why = f"no place in the tree: {exc}"
        elif why is None and tree.replicas(rec.key, ready_only=False) and any(
                loc.instance == rec.instance for loc in tree.replicas(rec.key, ready_only=False)):
            why = "a second record of this segment on the instance"
        if why is not None:
            refuse(rec, why)
            continue
        taken.add((rec.instance, rec.slot))
        tree.add_replica(rec.key, rec.instance, rec.slot, rec.last_access, ready=True)
        report.restored[rec.instance] = report.restored.get(rec.instance, 0) + 1
    for inst in capacity:
        slots.take_many(inst, [s for i, s in taken if i == inst])
    return report


def _fault(pool: CachePool, rec: SlotRecord, capacity: dict[int, int],
           taken: set[tuple[int, int]]) -> str | None:
    """Why ``rec`` cannot be adopted as it stands, or ``None``."""
    if rec.instance not in capacity or not 0 <= rec.slot < capacity[rec.instance]:
        return "no such slot in this pool"
    if (rec.instance, rec.slot) in taken:
        return "slot taken twice"
    if len(rec.key) != KEY_BYTES or (rec.parent is not None and len(rec.parent) != KEY_BYTES):
        return "malformed key"
    if rec.index < 0 or (rec.index > 0 and rec.parent is None):
        return "malformed index"
    if not record_key_ok(pool, rec):
        return "its key is not the hash of its parent and tokens"
    return None

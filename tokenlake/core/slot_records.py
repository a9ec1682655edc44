"""What each slot holds, kept beside the slot so that a new control process can adopt
the pool (docs/design.md §4 "Restart").

The control plane is the single writer of cache metadata, but its tree lives in one
process, and the KV in the instances. So that a crash of that process does not empty a
pool whose slabs are intact, every slot that holds a *ready* replica also has a
**record**: the segment's key, its parent's key, its index, its token ids and when it
was last read. The tree tells a :class:`SlotJournal` about every change of a ready
replica (:attr:`tokenlake.core.prefix_tree.PrefixTree.journal`):

* ``sealed``: a replica became ready (all its layers stored: a completed put, a
  finished replication, a shared tail, an eviction undone);
* ``touched``: it was read (its LRU time);
* ``cleared``: it left the tree (evicted, aborted, migrated, its instance removed).

A pending replica has no record (its slot's is clear: a slot is cleared when it leaves
the tree and only a ready replica writes one), so a segment whose bytes were not all
stored is never adopted. :func:`tokenlake.core.restore.restore` rebuilds a pool's tree
from the records a new control process reads back; the launcher keeps the records (the
shared tables of :mod:`tokenlake.deploy.records`).

Pure: no torch, no numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenlake.core.segments import SegmentKey


class SlotJournal(Protocol):
    """Where the records of ready replicas are kept (see the module docstring)."""

    def sealed(self, instance: int, slot: int, key: SegmentKey, parent: SegmentKey | None,
               index: int, tokens: bytes | None, last_access: float) -> None:
        """Slot ``slot`` of ``instance`` holds segment ``key`` in full (``tokens``: its
        token ids as int32 bytes, ``None`` if unknown; ``last_access``: seconds of the
        pool's clock)."""

    def touched(self, instance: int, slot: int, last_access: float) -> None:
        """The replica in this slot was read at ``last_access`` (the pool's clock)."""

    def cleared(self, instance: int, slot: int) -> None:
        """The slot holds no ready replica any more."""


@dataclass(frozen=True)
class SlotRecord:
    """One slot's record as read back (``last_access``: seconds of the pool's clock)."""

    instance: int
    slot: int
    key: SegmentKey
    parent: SegmentKey | None  # None: a first segment without salt
    index: int
    tokens: bytes | None  # int32 token ids; None: not recorded
    last_access: float

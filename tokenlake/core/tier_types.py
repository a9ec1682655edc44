"""The tier's records (:mod:`tokenlake.core.tier`): the work handed to the data plane
(:class:`TierOps`, :class:`TierWrite`, :class:`Promotion`), what moves it
(:class:`TierDataPlane`) and the counters (:class:`TierStats`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenlake.core.segments import SegmentKey


@dataclass(frozen=True)
class TierWrite:
    """Copy ``slot`` (segment ``key``, all layers) into the instance's tier, with where
    the segment goes in the tree: ``parent`` (``None``: the unsalted root), ``index``,
    ``tokens`` (int32 bytes), for a restart to put it back (:meth:`TierManager.adopt`)."""

    key: SegmentKey
    slot: int
    parent: SegmentKey | None = None
    index: int = 0
    tokens: bytes | None = None


@dataclass
class TierOps:
    """What one instance's transfer engine does next, in this order: delete the files
    of ``drops``, then stage and write ``writes``."""

    drops: list[SegmentKey] = field(default_factory=list)
    writes: list[TierWrite] = field(default_factory=list)


@dataclass(frozen=True)
class Promotion:
    """Read segment ``key``'s file from ``instance``'s tier into ``slot`` of instance
    ``target`` (``instance`` itself, or one whose slab it writes directly: a co-located
    one), a pending replica until :meth:`TierManager.promoted`."""

    key: SegmentKey
    instance: int
    slot: int
    target: int = -1  # -1: ``instance``
    #: the pending replica it added (a tree ``Replica``): the promotion's own while the
    #: tree still holds that very object (the segment may have gone and come back since)
    replica: Any = field(default=None, compare=False, repr=False)

    @property
    def to(self) -> int:
        """The instance whose slot receives the segment."""
        return self.instance if self.target < 0 else self.target


@dataclass(frozen=True)
class TierStats:
    """The tiers' counters: copies held per instance, and what moved."""

    held: dict[int, int]  # copies in each instance's tier
    capacity: int  # copies one instance's tier holds (tier_slots)
    written: int  # copies written through
    demotions: int  # segments that left the slabs and stayed in a tier
    promotions: int  # segments read back into a slot
    failed_promotions: int  # ... whose file was missing or corrupt (the segment went)
    dropped: int  # copies the tiers evicted or lost
    # per instance, its transfer engine's own counters as of its last answer (the names
    # of tokenlake.dataplane.messages.tier.TIER_COUNTERS: write errors, reads that
    # failed, staged bytes, seconds waited on the bandwidth limit, ...); empty before one
    engines: dict[int, dict[str, float]] = field(default_factory=dict)


class TierDataPlane(Protocol):
    """What moves the tiers' data (a launcher's driver, through the transfer engines)."""

    def tier_ops(self, ops: dict[int, TierOps]) -> tuple[list[SegmentKey], list[SegmentKey]]:
        """Runs each instance's ops; returns the write-throughs staged and refused."""

    def tier_read(self, promotions: Sequence[Promotion]) -> tuple[set[SegmentKey], dict[SegmentKey, int]]:
        """Reads each promotion's copy into its slot; returns the keys that failed, and
        those of them whose engine neither answered nor was fenced (it may still write
        their slots), with the epoch of the instance each was sent at."""

    def fenced(self) -> dict[int, int]:
        """Per instance, the highest epoch whose fence its engine answered: nothing
        sent at a lower one can touch a slot any more."""

    def counters(self) -> dict[int, dict[str, float]]:
        """Per instance, its engine's tier counters as of its last answer
        (:attr:`TierStats.engines`)."""

"""The transaction of one ``gen_plans`` call: what it changed, and how to finish it.

Planning an iteration changes the pool before any data moves: new requests are
admitted with their prefix leased, new segments get pending replicas or seal an open
tail, new open tails take private slots, and a full pool evicts. A
:class:`Transaction` records each change as it is made (a typed undo log, the
:class:`~tokenlake.core.pool.Eviction` records the pool returned, the requests'
snapshots and the hit counts), and ends in one of three ways:

* :meth:`Transaction.commit`: the data plane stored every layer; the new segments
  become visible and open tails that filled into cached segments are released;
* :meth:`Transaction.rollback`: ``gen_plans`` failed before returning. Every change is
  undone newest first and the evicted replicas are put back (their slots still hold
  their data), so the pool and the requests are exactly as before the call;
* :meth:`Transaction.abort`: the data plane failed to run the plans. Every change is
  undone, but evicted replicas stay evicted (their slots may have been written).

When an instance leaves the pool while a transaction is in flight, the segments that
went with it are :meth:`Transaction.forget`-ten: the undo and the commit leave them
alone (the same key may be stored again meanwhile, by a later transaction).

Invariant (checked by :meth:`Transaction.check` while in flight): every segment the
transaction stores and has not forgotten is in the tree with a pending replica on the
instance it is stored to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from tokenlake.core.pool import CachePool, Eviction, Placement
from tokenlake.core.prefix_tree import SegmentLocation
from tokenlake.core.segments import SegmentKey


class RequestLedger(Protocol):
    """What a transaction needs of the request table
    (:class:`~tokenlake.core.request_table.RequestTable` is one). Snapshots are the table's
    own values, opaque here: the transaction only keeps them and hands them back."""

    def set_idle(self, request_ids: Iterable[str]) -> None:
        """The requests' plans are finished (committed or aborted)."""

    def restore(self, snapshots: Mapping[str, object | None]) -> None:
        """Puts each request back as its snapshot says (``None``: it was admitted by the
        transaction and leaves the table)."""


@dataclass
class PlanCounts:
    """Hit accounting of the control plane (requests and tokens; segments for dedup)."""

    admitted: int = 0  # requests admitted
    hit_tokens: int = 0  # declared prefix tokens reused from the pool at admission
    prefill_tokens: int = 0  # tokens computed in prefill batches
    dedup_segments: int = 0  # sealed segments found cached instead of stored again

    def add(self, other: PlanCounts, sign: int = 1) -> None:
        """Adds ``other`` (``sign=-1`` takes it back)."""
        self.admitted += sign * other.admitted
        self.hit_tokens += sign * other.hit_tokens
        self.prefill_tokens += sign * other.prefill_tokens
        self.dedup_segments += sign * other.dedup_segments


# ------------------------------------------------------------- the undo log
@dataclass(frozen=True, slots=True)
class _Leased:
    keys: tuple[SegmentKey, ...]

    def undo(self, pool: CachePool, gone: set[SegmentKey]) -> None:
        pool.unlease([k for k in self.keys if k not in gone], missing_ok=True)


@dataclass(frozen=True, slots=True)
class _Placed:
    key: SegmentKey
    instance: int

    def undo(self, pool: CachePool, gone: set[SegmentKey]) -> None:
        if self.key not in gone:
            pool.abort(self.key, self.instance)


@dataclass(frozen=True, slots=True)
class _Sealed:
    key: SegmentKey
    tail: SegmentLocation
    owner: str

    def undo(self, pool: CachePool, gone: set[SegmentKey]) -> None:
        if self.key not in gone:
            pool.unseal(self.key, self.tail, self.owner)


@dataclass(frozen=True, slots=True)
class _OpenedTail:
    tail: SegmentLocation
    owner: str

    def undo(self, pool: CachePool, gone: set[SegmentKey]) -> None:
        pool.release_private(self.tail, self.owner)  # a no-op if it went with an instance


_Undo = _Leased | _Placed | _Sealed | _OpenedTail


class Transaction:
    """The changes of one iteration's planning, until it is committed or undone.

    Args:
        iteration: the iteration number of the plans (``Plans.iteration``).
    """

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration
        self.requests: list[str] = []  # requests taking part, in planning order
        self.snapshots: dict[str, object | None] = {}  # None: admitted by it
        self.commits: list[tuple[SegmentKey, int]] = []  # (segment, instance) it stores
        self.release_on_commit: list[tuple[SegmentLocation, str]] = []  # (open tail, owner)
        self.evictions: list[Eviction] = []  # oldest first
        self.borrows: list[SegmentKey] = []  # leased for this iteration only (page hits)
        self.counts = PlanCounts()
        self._undo: list[_Undo] = []
        self._stored: set[SegmentKey] = set()  # keys of ``commits``
        self._gone: set[SegmentKey] = set()  # forgotten: went with a removed instance
        self.reads: frozenset[int] = frozenset()  # instances whose slots its plans read
        self.left: int | None = None  # one of them, removed while it was in flight

    # ------------------------------------------------------------- recording
    def join(self, request_id: str) -> None:
        """The request takes part in this iteration."""
        self.requests.append(request_id)

    def remember(self, request_id: str, snapshot: object | None) -> None:
        """The request's state before the iteration (``None``: admitted by it)."""
        self.snapshots[request_id] = snapshot

    def leased(self, keys: tuple[SegmentKey, ...]) -> None:
        """``keys`` were leased (undo: unlease them)."""
        self._undo.append(_Leased(keys))

    def borrowed(self, key: SegmentKey) -> None:
        """A page hit reads segment ``key`` in place this iteration and copies its pages:
        leased now, released when the transaction ends either way."""
        self._undo.append(_Leased((key,)))
        self.borrows.append(key)

    def placed(self, key: SegmentKey, placement: Placement) -> None:
        """New segment ``key`` got a pending replica (undo: drop it)."""
        loc = placement.location
        self._undo.append(_Placed(key, loc.instance))
        self._stores(key, loc.instance, placement.evicted)

    def sealed(self, key: SegmentKey, tail: SegmentLocation, owner: str) -> None:
        """``owner``'s open tail became new segment ``key`` (undo: private again)."""
        self._undo.append(_Sealed(key, tail, owner))
        self._stores(key, tail.instance, None)

    def opened_tail(self, placement: Placement, owner: str) -> None:
        """``owner`` got a private slot for a new open tail (undo: release it)."""
        self._undo.append(_OpenedTail(placement.location, owner))
        if placement.evicted is not None:
            self.evictions.append(placement.evicted)

    def release_after_commit(self, tail: SegmentLocation, owner: str) -> None:
        """``owner``'s open tail filled into a cached segment: free it on commit (its
        plan still writes rows there)."""
        self.release_on_commit.append((tail, owner))

    def stores(self, key: SegmentKey) -> bool:
        """True if this transaction stores segment ``key``."""
        return key in self._stored

    def forget(self, keys: set[SegmentKey], instance: int) -> None:
        """``keys`` went with removed ``instance``: leave them alone from now on. If its
        plans read that instance's slots, it can no longer be committed (a reader that
        attended them in place may have read them after they were zeroed or reused)."""
        self._gone |= keys
        if instance in self.reads:
            self.left = instance

    def _stores(self, key: SegmentKey, instance: int, evicted: Eviction | None) -> None:
        self.commits.append((key, instance))
        self._stored.add(key)
        if evicted is not None:
            self.evictions.append(evicted)

    # -------------------------------------------------------------- outcomes
    def commit(self, pool: CachePool, requests: RequestLedger) -> None:
        """Every put is stored in all layers: new segments become visible."""
        for key, inst in self.commits:
            if key in pool.tree and key not in self._gone:
                pool.commit(key, inst)
        for entry in self._undo:
            if type(entry) is _Placed and entry.key not in self._gone:
                pool.count_placement(entry.key, entry.instance)
        for tail, owner in self.release_on_commit:
            pool.release_private(tail, owner)
        pool.unlease([k for k in self.borrows if k not in self._gone], missing_ok=True)
        requests.set_idle(self.requests)

    def rollback(self, pool: CachePool, requests: RequestLedger) -> None:
        """Planning failed before any data moved: the pool and the requests are left
        exactly as before, evicted replicas included."""
        self._undo_all(pool, requests)
        pool.restore_evicted(self.evictions)

    def abort(self, pool: CachePool, requests: RequestLedger) -> None:
        """The data plane failed to run the plans: undone; requests keep their old state."""
        self._undo_all(pool, requests)
        requests.set_idle(self.requests)

    def _undo_all(self, pool: CachePool, requests: RequestLedger) -> None:
        for entry in reversed(self._undo):
            entry.undo(pool, self._gone)
        self._undo.clear()
        requests.restore(self.snapshots)

    def check(self, pool: CachePool) -> None:
        """Asserts the invariant of the module docstring (for tests)."""
        tree = pool.tree
        for key, inst in self.commits:
            if key in self._gone:
                continue
            assert key in tree, "a segment in flight left the tree"
            assert any(loc.instance == inst for loc in tree.replicas(key, ready_only=False))
            assert all(loc.instance != inst for loc in tree.replicas(key)), "stored too early"

"""The request table of the control plane: what every live request holds in the pool.

A live request holds a *chain* of sealed segments (leased for its lifetime, so a
running request never loses its prefix) and at most one private *open tail*: a slot
with fewer than ``C`` tokens that becomes a shared segment when it fills (docs/design.md §4).
The query side of a request (which replica of each segment to read) is resolved once
and reused every iteration until the chain grows or replicas change (the table's
*epoch* moves).

A request may carry a *cache salt* (``BatchRequest.cache_salt``, read on its first
iteration): its chain then starts at that salt's root in the prefix tree, so it matches,
stores and shares segments only with requests under the same salt.

Invariants (checked by :meth:`RequestTable.check`), for every request not marked lost:

* its chain is a path from its salt's root of the prefix tree (the unsalted root
  without a salt; segment ``i`` at index ``i``, each the child of the one before);
* it has an open tail exactly when it has tail tokens, fewer than ``C`` of them, and
  the tail's slot is a private slot the pool holds for this request;

and for every request: each of its chain's segments still in the tree carries at least
one lease per request holding it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from tokenlake.core.errors import PlanError, PrefixNotCached
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.prefix_tree import SegmentLocation
from tokenlake.core.segments import SegmentKey, check_salt

if TYPE_CHECKING:  # annotations only: the pool and the transaction do not import this module
    from tokenlake.core.pool import CachePool, InstanceRemoval
    from tokenlake.core.transaction import Transaction


class RequestSnapshot(NamedTuple):
    """What :meth:`RequestState.restore` needs to undo one iteration (during an
    iteration the chain only grows and the tail token list is only extended in place
    or replaced)."""

    chain_len: int
    tail: SegmentLocation | None
    tail_tokens: list[int]  # the list object itself, cut back to ``tail_len`` on restore
    tail_len: int


@dataclass
class RequestState:
    """Mutable state of one live request (owned by :class:`RequestTable`)."""

    request_id: str
    chain: list[SegmentKey] = field(default_factory=list)
    salt: str | None = None  # its cache salt (None: none)
    root: SegmentKey | None = None  # the parent of its first segment: its salt's root key
    tail: SegmentLocation | None = None
    tail_tokens: list[int] = field(default_factory=list)
    # A page hit not yet copied: (segment, tokens) its first iteration reads in place.
    borrow: tuple[SegmentKey, int] | None = None
    busy: int = -1  # iteration whose plans are in flight for this request, -1 if none
    lost: bool = False  # part of its prefix went with a removed instance: finish it
    # Query-side resolution cache (see RequestTable.resolve).
    epoch: int = -1
    keys: tuple[SegmentKey, ...] = ()
    chosen: tuple[int, ...] = ()  # instance read for each of ``keys``
    # (index in ``keys``, ready replicas) of the segments with several replicas
    multi: tuple[tuple[int, tuple[SegmentLocation, ...]], ...] = ()
    by_instance: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    histogram: dict[int, int] = field(default_factory=dict)
    version: int = -1  # changes whenever the resolution above is redone

    @property
    def tip(self) -> SegmentKey | None:
        """The key the request's next segment chains from: its last sealed segment,
        else its root (``None``: unsalted)."""
        return self.chain[-1] if self.chain else self.root

    def prefix_tokens(self, segment_tokens: int) -> int:
        """Tokens of this request held by the pool (sealed chain plus open tail)."""
        return len(self.chain) * segment_tokens + len(self.tail_tokens)

    def snapshot(self) -> RequestSnapshot:
        """State to restore if the iteration fails."""
        return RequestSnapshot(len(self.chain), self.tail, self.tail_tokens, len(self.tail_tokens))

    def restore(self, snap: RequestSnapshot) -> None:
        del self.chain[snap.chain_len :]
        self.tail, self.tail_tokens = snap.tail, snap.tail_tokens
        del self.tail_tokens[snap.tail_len :]
        self.epoch = -1


class NewTokenPut(NamedTuple):
    """Rows ``[start, stop)`` of a request's new tokens go to ``offset`` of a slot.

    Internal to ``gen_plans`` (a NamedTuple: immutable and cheap to build on the hot
    path); the public form is :class:`tokenlake.core.plans.PutItem`."""

    start: int
    stop: int
    instance: int
    slot: int
    offset: int
    key: SegmentKey | None


class RequestTable:
    """Live requests of one control plane, by request id.

    Args:
        segment_tokens: ``C``, tokens per segment.
    """

    def __init__(self, segment_tokens: int) -> None:
        self._c = segment_tokens
        self._states: dict[str, RequestState] = {}
        self._epoch = 0  # moves when replicas appear or vanish: resolutions are redone
        self._versions = itertools.count()  # resolution versions, unique in this table

    # ----------------------------------------------------------------- lookup
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def ids(self) -> tuple[str, ...]:
        """Live request ids, in admission order."""
        return tuple(self._states)

    def states(self) -> tuple[RequestState, ...]:
        """Live requests' states (read them; the table changes them)."""
        return tuple(self._states.values())

    def prefix_tokens(self, request_id: str) -> int:
        """Tokens of a live request held by the pool; ``KeyError`` if it is unknown."""
        return self._states[request_id].prefix_tokens(self._c)

    # ------------------------------------------------------------- admission
    def validate(self, batches: Sequence[Batch], dops: Sequence[int], n_instances: int) -> None:
        """Raises :class:`PlanError` unless ``batches`` with ``dops`` can be planned now:
        as many DoPs as batches, positive, fitting ``n_instances``; no empty batch or
        unknown phase; each request once, with new tokens, not in flight, not lost,
        declaring a prefix only on its first iteration, with a valid cache salt that a
        later iteration either leaves out or repeats."""
        if len(batches) != len(dops):
            raise PlanError(f"{len(batches)} batches but {len(dops)} DoPs")
        if any(type(d) is not int or d < 1 for d in dops):
            raise PlanError(f"every DoP must be a positive int, got {list(dops)}")
        if sum(dops) > n_instances:
            raise PlanError(f"sub-batches ({sum(dops)}) exceed instances ({n_instances})")
        seen: set[str] = set()
        for b, batch in enumerate(batches):
            if not batch.requests:
                raise PlanError(f"batch {b} is empty")
            if batch.phase not in ("prefill", "decode"):
                raise PlanError(f"batch {b} has unknown phase {batch.phase!r}")
            for req in batch.requests:
                if req.request_id in seen:
                    raise PlanError(f"request {req.request_id!r} appears twice in one iteration")
                seen.add(req.request_id)
                self._validate_request(req)

    def _validate_request(self, req: BatchRequest) -> None:
        rid = req.request_id
        if not req.new_token_ids:
            raise PlanError(f"request {rid!r} has no new tokens")
        salt = req.cache_salt
        if salt is not None:
            salt = check_salt(salt)
        state = self._states.get(rid)
        if state is None:
            return
        if salt is not None and salt != state.salt:
            raise PlanError(f"request {rid!r} is live under another cache salt; a later "
                            "iteration repeats its salt or leaves it out")
        if state.busy >= 0:
            raise PlanError(f"request {rid!r} has plans in flight")
        if state.lost:
            raise PlanError(
                f"request {rid!r} lost part of its prefix with a removed instance; "
                "finish it and recompute"
            )
        if req.prefix_token_ids:
            raise PlanError(f"request {rid!r} is live; send prefix_token_ids only first")

    def admit(self, req: BatchRequest, pool: CachePool, tx: Transaction) -> RequestState:
        """The request takes part in ``tx``: a live one is snapshotted, a new one is
        admitted with its declared prefix leased. Raises :class:`PrefixNotCached` if
        that prefix is not whole segments, all cached and ready."""
        rid = req.request_id
        state = self._states.get(rid)
        tx.join(rid)
        if state is not None:
            tx.remember(rid, state.snapshot())
            return state
        prefix = req.prefix_token_ids
        state = self._leased_state(rid, prefix, pool, check_salt(req.cache_salt), pages=True)
        tx.leased(tuple(state.chain))
        if state.borrow is not None:  # held until the copy of its pages is stored
            pool.lease([state.borrow[0]])
            tx.borrowed(state.borrow[0])
        self._states[rid] = state
        tx.remember(rid, None)
        tx.counts.admitted += 1
        tx.counts.hit_tokens += len(prefix)
        return state

    # ------------------------------------------------------------- resolution
    def invalidate_reads(self) -> None:
        """Replicas appeared or vanished: every request's reads are resolved anew."""
        self._epoch += 1

    def resolve(self, state: RequestState, pool: CachePool) -> None:
        """Chooses one ready replica per chain segment by power of two choices on the
        instances' windowed load, every iteration (paper §4.3: per query). The chain's
        replica sets are looked up again only when the chain or the epoch changes; in
        between only segments with several replicas are chosen again, and the
        resolution's ``version`` moves only when a choice changed. Raises
        :class:`PlanError` for a segment no plan has finished storing yet."""
        if state.epoch == self._epoch and len(state.keys) == len(state.chain):
            if state.multi:
                self._choose_again(state, pool)
            return
        tree = pool.tree
        load = pool.instance_load()
        locs_of: list[tuple[SegmentLocation, ...]] = []
        picks: list[SegmentLocation] = []
        for key in state.chain:
            locs = tree.replicas(key)
            if not locs:
                raise PlanError(
                    f"segment {key.hex()} of request {state.request_id!r} is still being "
                    "stored; complete the iteration that stores it first"
                )
            loc = pool.choose(locs, load)
            load[loc.instance] = load.get(loc.instance, 0) + 1
            locs_of.append(locs)
            picks.append(loc)
        state.keys = tuple(state.chain)
        state.multi = tuple((i, locs) for i, locs in enumerate(locs_of) if len(locs) > 1)
        self._set_resolution(state, picks)
        state.epoch = self._epoch

    def _choose_again(self, state: RequestState, pool: CachePool) -> None:
        """This iteration's choice among the replicas of the chain's replicated segments."""
        load = pool.instance_load()
        picks: list[SegmentLocation] | None = None
        for i, locs in state.multi:
            loc = pool.choose(locs, load)
            load[loc.instance] = load.get(loc.instance, 0) + 1
            if loc.instance != state.chosen[i]:
                if picks is None:
                    picks = [next(loc for loc in pool.tree.replicas(state.keys[j])
                                  if loc.instance == inst)
                             for j, inst in enumerate(state.chosen)]
                picks[i] = loc
        if picks is not None:
            self._set_resolution(state, picks)

    def _set_resolution(self, state: RequestState, picks: Sequence[SegmentLocation]) -> None:
        c = self._c
        by_instance: dict[int, tuple[list[int], list[int]]] = {}
        for loc in picks:
            slots, toks = by_instance.setdefault(loc.instance, ([], []))
            slots.append(loc.slot)
            toks.append(c)
        state.by_instance = {i: (tuple(s), tuple(t)) for i, (s, t) in by_instance.items()}
        state.version = next(self._versions)
        state.histogram = {i: len(s) for i, (s, _) in by_instance.items()}
        state.chosen = tuple(loc.instance for loc in picks)

    # -------------------------------------------------------------- lifecycle
    def set_busy(self, request_ids: Iterable[str], iteration: int) -> None:
        for rid in request_ids:
            self._states[rid].busy = iteration

    def set_idle(self, request_ids: Iterable[str]) -> None:
        """Their plans completed or were aborted (requests finished since are skipped)."""
        for rid in request_ids:
            state = self._states.get(rid)
            if state is not None:
                state.busy = -1

    def restore(self, snapshots: Mapping[str, RequestSnapshot | None]) -> None:
        """Undoes an iteration: requests admitted by it (``None``) leave the table, the
        others get their snapshot back."""
        for rid, snap in snapshots.items():
            if snap is None:
                self._states.pop(rid, None)
            else:
                self._states[rid].restore(snap)

    def admit_leased(self, request_id: str, prefix: Sequence[int], pool: CachePool,
                     salt: str | None = None) -> RequestState:
        """Admits a new request holding ``prefix`` (whole segments, all ready, stored
        under cache salt ``salt``) leased, outside any iteration: for a framework that
        copies the prefix's KV out of the pool. Raises :class:`PlanError` for a live id
        or a bad salt, :class:`PrefixNotCached` like :meth:`admit`; changes nothing
        then."""
        salt = check_salt(salt)
        if request_id in self._states:
            raise PlanError(f"request {request_id!r} is live already")
        if not prefix:
            raise PrefixNotCached(f"request {request_id!r}: no prefix to lease")
        state = self._leased_state(request_id, prefix, pool, salt)
        self._states[request_id] = state
        self.resolve(state, pool)
        return state

    def _leased_state(self, rid: str, prefix: Sequence[int], pool: CachePool,
                      salt: str | None, pages: bool = False) -> RequestState:
        """A new request's state under cache salt ``salt`` (checked) holding ``prefix``
        leased (not registered yet), and with ``pages`` the partial segment a page hit
        borrows (leased by the caller). Raises :class:`PrefixNotCached` unless the
        prefix is whole segments (then whole pages of the next one, with ``pages``), all
        cached and ready under that salt."""
        c = self._c
        unit = pool.tree.page_tokens if pages else c
        if len(prefix) % unit:
            what = "page" if pages and unit < c else "segment"
            raise PrefixNotCached(
                f"request {rid!r}: prefix of {len(prefix)} tokens is not a whole "
                f"number of {unit}-token {what}s", (rid,)
            )
        match = pool.tree.match(prefix, salt=salt)
        if match.hit_tokens != len(prefix):
            raise PrefixNotCached(
                f"request {rid!r}: only {match.hit_tokens} of {len(prefix)} prefix "
                "tokens are cached and ready" + (" under its cache salt" if salt else ""), (rid,)
            )
        root = None if salt is None else pool.hasher.salt_root(salt)
        state = RequestState(rid, chain=list(match.keys), salt=salt, root=root)
        if match.partial_key is not None:
            state.borrow = (match.partial_key, match.partial_tokens)
        pool.lease(state.chain)
        return state

    def finish(self, request_id: str, pool: CachePool) -> None:
        """The request is done: its chain's leases go back to the pool, and its open
        tail stays there as a tail node for page hits (:meth:`CachePool.share_tail`).
        Raises :class:`PlanError` if it is unknown or has plans in flight."""
        state = self._states.get(request_id)
        if state is None:
            raise PlanError(f"unknown request {request_id!r}")
        if state.busy >= 0:
            raise PlanError(f"request {request_id!r} has plans in flight; complete or abort first")
        del self._states[request_id]
        if state.tail is not None:  # kept for page hits while its parent is leased
            if state.lost or self._c <= 1:
                pool.release_private(state.tail, request_id)
            else:
                pool.share_tail(state.tail, request_id, state.tip, len(state.chain), state.tail_tokens)
        pool.release_chain(state.chain, zip(state.keys, state.chosen))

    def mark_lost(self, removal: InstanceRemoval) -> tuple[str, ...]:
        """An instance left the pool: requests whose chain lost a segment, or whose open
        tail was there, are marked lost. Returns their ids (sorted), with the owners of
        private slots that went with it."""
        gone = set(removal.removed_keys)
        lost = set(removal.lost_private)
        for rid, state in self._states.items():
            cut = next((i for i, k in enumerate(state.chain) if k in gone), None)
            if cut is not None:
                # The gone keys are a suffix (a subtree went) and their leases went with
                # them: drop them, or finishing the request would unlease a segment that
                # was stored again meanwhile, under another request's lease.
                del state.chain[cut:]
                lost.add(rid)
        for rid in lost:
            state = self._states.get(rid)
            if state is not None:
                state.lost = True
                if state.tail is not None and state.tail.instance == removal.instance:
                    state.tail = None
        return tuple(sorted(lost))

    # ------------------------------------------------------------- invariants
    def check(self, pool: CachePool) -> None:
        """Asserts the invariants listed in the module docstring (for tests)."""
        tree = pool.tree
        holders: Counter = Counter()
        for rid, state in self._states.items():
            assert state.request_id == rid
            holders.update(k for k in state.chain if k in tree)
            if state.lost:
                continue
            for i, key in enumerate(state.chain):
                assert key in tree, f"request {rid!r} holds a segment that left the tree"
                assert tree.index(key) == i, "chain out of order"
                assert tree.parent(key) == (state.chain[i - 1] if i else state.root), "broken chain"
            assert state.root == tree.root_key(state.salt), "a request's root is not its salt's"
            if state.tail is None:
                assert not state.tail_tokens, f"request {rid!r} has tail tokens but no tail"
            else:
                assert 0 < len(state.tail_tokens) < self._c, "open tail empty or full"
                assert pool.private_owner(state.tail) == rid, "open tail not held privately"
        for key, n in holders.items():
            assert tree.lease_count(key) >= n, "a live request's segment is not leased"

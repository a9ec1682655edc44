"""Store planning: where every new token of an iteration goes (the first step of ``gen_plans``).

For each request of an iteration :class:`StorePlanner` admits it (a new request's
declared prefix is leased), resolves which replica of each prefix segment it reads, and
gives every new token a slot:

* tokens that fit the request's open tail are written there (the decode fast path);
* each segment the new tokens complete is sealed under its chained key (chained from
  the request's salt's root: dedup never crosses cache salts), and stored only if the
  pool does not hold it yet (dedup); a filled open tail becomes the segment's
  replica in place, or is released after commit when the segment was cached;
* the remaining tokens (fewer than ``C``) open a new private tail.

A new request whose declared prefix ends with a page hit (the first pages of a cached
segment ``S``) reads those pages from ``S`` in place in its first iteration, and gets an
open tail on the instance of the ``S`` replica it reads (elsewhere only when no instance
holding ``S`` can give a slot), into which the transfer plan copies ``S``'s pages
(:class:`~tokenlake.core.plans.PageCopy`) while its own new tokens are written after
them. From then on the tail is an ordinary open tail: it fills,
seals under its chained key, and every later request matches it (docs/design.md §4).

Every change goes through the pool and is recorded in the iteration's
:class:`~tokenlake.core.transaction.Transaction`, so a failure undoes it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from tokenlake.core.assembly import Prepared
from tokenlake.core.errors import CapacityError, SegmentInFlight
from tokenlake.core.plans import Batch
from tokenlake.core.pool import CachePool
from tokenlake.core.prefix_tree import SegmentLocation
from tokenlake.core.request_table import NewTokenPut, RequestState, RequestTable
from tokenlake.core.segments import SegmentKey
from tokenlake.core.transaction import Transaction


class StorePlanner:
    """Places the new tokens of each iteration (see the module docstring).

    Args:
        pool: the cache pool (every change to it goes through its methods).
        requests: the request table.
    """

    def __init__(self, pool: CachePool, requests: RequestTable) -> None:
        self._pool = pool
        self._requests = requests
        self._c = pool.config.segment_tokens

    def prepare(self, batches: Sequence[Batch], tx: Transaction) -> dict[str, Prepared]:
        """Admits new requests, resolves prefixes and places new tokens, per request.

        Every request is admitted (its declared prefix leased) before any is placed: a
        placement may evict, and must not take a later request's declared prefix.
        """
        out = {}
        c, pool, table = self._c, self._pool, self._requests
        admitted = [(batch, req, table.admit(req, pool, tx))
                    for batch in batches for req in batch.requests]
        for batch, req, state in admitted:
            copy = None
            if state.borrow is not None:
                read, copy = self._take_borrow(state, tx)
            have = len(state.tail_tokens)
            prefix_tokens = len(state.chain) * c + have
            table.resolve(state, pool)
            tail = state.tail
            new = req.new_token_ids
            if copy is not None:  # the tail's head is still being copied: read S in place
                tail_item = read
                puts = tuple(self._place_new_tokens(state, new, tx))
            elif tail is not None and have + len(new) < c:  # decode fast path: tail grows
                tail_item = (tail.instance, tail.slot, have)
                puts = (NewTokenPut(0, len(new), tail.instance, tail.slot, have, None),)
                state.tail_tokens.extend(new)
            else:
                tail_item = (tail.instance, tail.slot, have) if tail else None
                puts = tuple(self._place_new_tokens(state, new, tx))
            if batch.phase == "prefill":
                tx.counts.prefill_tokens += len(new)
            out[req.request_id] = Prepared(prefix_tokens, state, tail_item, puts, copy)
        return out

    def _take_borrow(self, state: RequestState, tx: Transaction):
        """A new request's page hit on segment ``S``: a private tail on the instance of
        the ``S`` replica it reads (or another holder's; failing those, wherever a new
        tail goes), headed by ``S``'s shared tokens. Returns the read of this iteration
        ``(instance, slot, tokens)`` and the copy into the tail (the fields of a
        :class:`~tokenlake.core.plans.PageCopy`). Raises :class:`CapacityError` when no
        slot can be had."""
        pool, key, n = self._pool, *state.borrow
        state.borrow = None
        locs = list(pool.tree.replicas(key))
        first = pool.choose(locs, pool.instance_load())
        locs.sort(key=lambda loc: loc.instance != first.instance)
        hint = state.request_id.encode() + len(state.chain).to_bytes(8, "little")
        for src in locs:
            try:
                placement = pool.allocate_private(state.request_id, hint, src.instance)
            except CapacityError:
                continue
            break
        else:  # every holder is full of what cannot be evicted: copy across instances
            src = first
            placement = pool.allocate_private(state.request_id, hint)
        tx.opened_tail(placement, state.request_id)
        pool.tree.touch(key, src.instance, pool.clock())
        shared = array("i")
        shared.frombytes(pool.tree.tokens(key)[: 4 * n])
        state.tail, state.tail_tokens = placement.location, shared.tolist()
        dst = placement.location
        return (src.instance, src.slot, n), (src.instance, src.slot, dst.instance, dst.slot, n)

    def _place_new_tokens(
        self, state: RequestState, tokens: tuple[int, ...], tx: Transaction
    ) -> list[NewTokenPut]:
        """Gives every new token a slot: fills the open tail, seals full segments
        (deduplicated against the tree), and opens a new private tail for the rest."""
        pool, hasher, c = self._pool, self._pool.hasher, self._c
        puts: list[NewTokenPut] = []
        pos, n = 0, len(tokens)
        if state.tail is not None:
            have = len(state.tail_tokens)
            take = min(c - have, n)
            if have + take < c:
                puts.append(NewTokenPut(0, take, state.tail.instance, state.tail.slot, have, None))
                state.tail_tokens.extend(tokens[:take])
                return puts
            seg = state.tail_tokens + list(tokens[:take])
            key = hasher.keys(seg, parent=state.tip)[0]
            self._extend_chain(state, key, state.tail, have, 0, take, puts, tx, seg)
            state.tail, state.tail_tokens = None, []
            pos = take
        full_end = pos + (n - pos) // c * c
        for key in hasher.iter_keys(tokens[pos:full_end], parent=state.tip):
            self._extend_chain(state, key, None, 0, pos, pos + c, puts, tx, tokens[pos : pos + c])
            pos += c
        if pos < n:
            hint = state.request_id.encode() + len(state.chain).to_bytes(8, "little")
            placement = pool.allocate_private(state.request_id, hint)
            tx.opened_tail(placement, state.request_id)
            loc = placement.location
            puts.append(NewTokenPut(pos, n, loc.instance, loc.slot, 0, None))
            state.tail, state.tail_tokens = loc, list(tokens[pos:])
        return puts

    def _extend_chain(
        self, state: RequestState, key: SegmentKey, tail: SegmentLocation | None,
        offset: int, start: int, stop: int, puts: list[NewTokenPut], tx: Transaction,
        seg: Sequence[int] = (),
    ) -> None:
        """Adds sealed segment ``key`` to the request's chain, storing rows only if new.

        ``tail`` is the request's open tail when the segment completes it (else
        ``None``); the segment takes rows ``[start, stop)`` of the request's new tokens,
        written from token ``offset`` of its slot. ``seg`` are the segment's ``C``
        tokens, recorded in the tree for page hits.
        """
        pool, tree, owner = self._pool, self._pool.tree, state.request_id
        parent = state.tip  # a root for the first segment: None, or its salt's root key
        # Held only in the disk tier (not promoted): stored again, as a new segment is.
        cached = key in tree and not tree.node(key).tier_only
        if cached and not tree.is_ready(key) and not tx.stores(key):
            # Being stored by another iteration in flight: its abort would pull the
            # segment from under this request (and it is not visible to plans yet). The
            # request waits: planned again once that iteration completed (it then reuses
            # the segment) or was aborted (it then stores the segment itself).
            raise SegmentInFlight(
                f"segment {key.hex()} of request {owner!r} is still being stored by another "
                "iteration in flight: plan the request again once it completed or aborted",
                (owner,))
        if cached:  # dedup: the pool already has (or this iteration stores) it
            tx.counts.dedup_segments += 1
            if tail is not None:
                tx.release_after_commit(tail, owner)
        elif tail is not None:
            pool.seal_private(tail, key, parent, len(state.chain), seg or None)
            tx.sealed(key, tail, owner)
            puts.append(NewTokenPut(start, stop, tail.instance, tail.slot, offset, key))
        else:
            placement = pool.place(key, parent, len(state.chain), seg or None)
            tx.placed(key, placement)
            loc = placement.location
            puts.append(NewTokenPut(start, stop, loc.instance, loc.slot, offset, key))
        pool.lease([key])
        tx.leased((key,))
        state.chain.append(key)

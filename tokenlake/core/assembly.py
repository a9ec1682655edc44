"""Assembly of sub-batch plans (the last step of ``gen_plans``).

:meth:`PartAssembler.assemble` splits every batch into DoP sub-batches of contiguous
rows, gives each sub-batch node the bytes it would send to every instance, matches the
nodes to instances (:mod:`tokenlake.core.dispatch`) and builds the query and transfer
plans with the chosen homes.

A sub-batch's query traffic has two parts: reads of *sealed* segments, which stay the
same from one decode step to the next, and reads of each request's private *open
tail*, which grows every step. :class:`PartAssembler` caches the sealed part of every
sub-batch, keyed by its requests, their rows and their resolution version, so a decode
iteration with an unchanged batch layout reuses last iteration's query tasks and only
builds the tails, spans and puts anew (plan once, run many).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tokenlake.core.dispatch import DispatchNode, dispatch, split_tokens
from tokenlake.core.errors import PlanError
from tokenlake.core.plans import (
    Batch,
    PageCopy,
    Plans,
    PutItem,
    QueryItem,
    QueryPlan,
    QueryTask,
    RowSpan,
    TransferPlan,
)
from tokenlake.core.request_table import NewTokenPut, RequestState
from tokenlake.core.segments import SegmentKey

Access = tuple[tuple[SegmentKey, ...], dict[int, int]]  # (chain, reads per instance)


class Prepared(NamedTuple):
    """What ``gen_plans`` decided for one request before assembly (internal; a
    NamedTuple because it is built for every request of every iteration)."""

    prefix_tokens: int  # tokens the pool held for the request before this iteration
    state: RequestState
    tail: tuple[int, int, int] | None  # (instance, slot, valid tokens) of the open tail
    puts: tuple[NewTokenPut, ...]
    copy: tuple[int, int, int, int, int] | None = None  # a page hit's PageCopy fields


@dataclass
class Part:
    """One sub-batch, before dispatch gives it a home."""

    batch: int
    part: int
    rows: int
    spans: tuple[RowSpan, ...]
    tasks: tuple[QueryTask, ...]  # sealed segments, by instance
    tails: tuple[QueryTask, ...]  # open tails, by instance
    puts: tuple[PutItem, ...]
    copies: tuple[PageCopy, ...]
    accesses: list[Access]  # per request, for access accounting
    query_rows: dict[int, int]  # q rows this part sends to each instance
    put_rows: dict[int, int]  # KV rows this part stores on each instance


class PartAssembler:
    """Builds the plans of each iteration; caches sealed query tasks across iterations.

    Args:
        query_row_bytes: bytes one q row costs per remote instance, all layers (q out,
            partial o and LSE back).
        kv_row_bytes: bytes of one token's KV, all layers.
    """

    def __init__(self, query_row_bytes: int, kv_row_bytes: int) -> None:
        self._query_row_bytes = query_row_bytes
        self._kv_row_bytes = kv_row_bytes
        self._prev: dict = {}
        self._cur: dict = {}

    def assemble(
        self, batches: Sequence[Batch], dops: Sequence[int], prepared: dict[str, Prepared],
        iteration: int, instances: Sequence[int], homes: Sequence[int | None] | None = None,
    ) -> tuple[Plans, list[Access]]:
        """Splits batches into sub-batches, dispatches them to distinct ``instances``, and
        builds the plans. Also returns the segment reads the plans make (one entry per
        request and sub-batch), for the pool's access accounting."""
        self.begin_iteration()
        parts: list[Part] = []
        for b, (batch, dop) in enumerate(zip(batches, dops)):
            offsets, total = [], 0
            for req in batch.requests:
                offsets.append(total)
                total += len(req.new_token_ids)
            for p, (lo, hi) in enumerate(split_tokens(total, dop)):
                parts.append(self.build(b, p, batch, offsets, prepared, lo, hi))
        qb, kb = self._query_row_bytes, self._kv_row_bytes
        nodes = [
            DispatchNode.from_counts(
                part.batch, part.part,
                {i: qb * r for i, r in part.query_rows.items()},
                {i: kb * r for i, r in part.put_rows.items()},
            )
            for part in parts
        ]
        homes = self._dispatch(parts, nodes, instances, homes)
        query_plans, transfer_plans = [], []
        groups: list[list[int]] = [[] for _ in batches]
        for part, home in zip(parts, homes):
            groups[part.batch].append(home)
            query_plans.append(
                QueryPlan(part.batch, part.part, home, part.rows, part.spans, part.tasks, part.tails)
            )
            stored = sum(put.stop - put.start for put in part.puts)
            transfer_plans.append(
                TransferPlan(part.batch, part.part, home, part.rows, part.puts,
                             part.rows - stored, part.copies)
            )
        plans = Plans(iteration, tuple(query_plans), tuple(transfer_plans), tuple(map(tuple, groups)))
        return plans, [a for part in parts for a in part.accesses]

    @staticmethod
    def _dispatch(parts, nodes, instances, pins) -> list[int]:
        """Each sub-batch's home: a pinned batch's own (checked by the caller), the rest
        by :func:`dispatch` over the instances no batch is pinned to."""
        pinned = {} if pins is None else {b: h for b, h in enumerate(pins) if h is not None}
        free = [i for i, part in enumerate(parts) if part.batch not in pinned]
        taken = set(pinned.values())
        chosen = dispatch([nodes[i] for i in free], [i for i in instances if i not in taken])
        homes = [pinned.get(part.batch, -1) for part in parts]
        for i, home in zip(free, chosen):
            homes[i] = home
        return homes

    def begin_iteration(self) -> None:
        """Keeps only the previous iteration's parts in the cache (bounded memory)."""
        self._prev, self._cur = self._cur, {}

    def build(
        self, b: int, p: int, batch: Batch, offsets: list[int], prepared: dict[str, Prepared],
        lo: int, hi: int,
    ) -> Part:
        """The sub-batch made of rows ``[lo, hi)`` of the batch's concatenated new tokens."""
        spans: list[RowSpan] = []
        puts: list[PutItem] = []
        copies: list[PageCopy] = []
        tails: dict[int, list[QueryItem]] = {}
        put_rows: dict[int, int] = {}
        tail_rows: dict[int, int] = {}  # q rows that only a tail (no sealed slot) draws there
        members, sig = [], []  # sig: what the sealed segments' tasks depend on
        for req, off in zip(batch.requests, offsets):
            n_new = len(req.new_token_ids)
            a, z = (off, off + n_new) if lo <= off and off + n_new <= hi else (max(lo, off), min(hi, off + n_new))
            if a >= z:
                continue
            prep = prepared[req.request_id]
            start, stop = a - lo, z - lo  # rows within the sub-batch
            first = a - off  # index of row ``start`` among the request's new tokens
            rid, state = req.request_id, prep.state
            spans.append(RowSpan(rid, start, stop, prep.prefix_tokens + first, prep.prefix_tokens))
            members.append((state, start, stop))
            sig.append((rid, state.version, start, stop))
            if prep.tail is not None:
                inst, slot, n = prep.tail
                tails.setdefault(inst, []).append(QueryItem(rid, start, stop, (slot,), (n,)))
                if inst not in state.by_instance:  # q rows travel once per instance
                    tail_rows[inst] = tail_rows.get(inst, 0) + stop - start
            last = first + stop - start
            if prep.copy is not None and first == 0:  # with the request's first rows
                copies.append(PageCopy(*prep.copy))
            for put in prep.puts:
                pa = put.start if put.start > first else first
                pz = put.stop if put.stop < last else last
                if pa < pz:
                    puts.append(PutItem(put.instance, put.slot, put.offset + pa - put.start,
                                        start + pa - first, start + pz - first, put.key))
                    put_rows[put.instance] = put_rows.get(put.instance, 0) + pz - pa
        tasks, sealed_rows, accesses = self._sealed(members, tuple(sig))
        query_rows = dict(sealed_rows)
        for inst, rows in tail_rows.items():
            query_rows[inst] = query_rows.get(inst, 0) + rows
        return Part(
            b, p, hi - lo, tuple(spans), tasks,
            tuple(QueryTask(i, tuple(items)) for i, items in sorted(tails.items())),
            tuple(puts), tuple(copies), accesses, query_rows, put_rows,
        )

    def _sealed(self, members: list[tuple[RequestState, int, int]], key: tuple):
        """Query tasks over sealed segments for ``(state, start, stop)`` members, cached
        under ``key`` (each member's request id, resolution version, start and stop)."""
        hit = self._cur.get(key) or self._prev.get(key)
        if hit is None:
            by_inst: dict[int, list[QueryItem]] = {}
            rows: dict[int, int] = {}
            accesses = []
            for state, start, stop in members:
                for inst, (slots, toks) in state.by_instance.items():
                    by_inst.setdefault(inst, []).append(
                        QueryItem(state.request_id, start, stop, slots, toks)
                    )
                    rows[inst] = rows.get(inst, 0) + stop - start
                if state.keys:
                    accesses.append((state.keys, state.histogram))
            tasks = tuple(QueryTask(i, tuple(items)) for i, items in sorted(by_inst.items()))
            hit = (tasks, rows, accesses)
        self._cur[key] = hit
        return hit


def check_homes(homes, dops: Sequence[int], instances) -> tuple[int | None, ...]:
    """``homes`` validated against the batches' DoPs and the live instances."""
    if homes is None:
        return (None,) * len(dops)
    homes = tuple(homes)
    if len(homes) != len(dops):
        raise PlanError(f"{len(dops)} batches but {len(homes)} homes")
    pinned = [h for h in homes if h is not None]
    for b, (h, d) in enumerate(zip(homes, dops)):
        if h is None:
            continue
        if type(h) is not int or h not in instances:
            raise PlanError(f"batch {b}: home {h!r} is not a live instance")
        if d != 1:
            raise PlanError(f"batch {b}: a pinned home needs DoP 1, got {d}")
    if len(set(pinned)) != len(pinned):
        raise PlanError(f"two batches pinned to one home: {pinned}")
    return homes

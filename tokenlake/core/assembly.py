"""Assembly of sub-batch plans (the last step of ``gen_plans``).

A sub-batch's query traffic has two parts: reads of *sealed* segments, which stay the
same from one decode step to the next, and reads of each request's private *open
tail*, which grows every step. :class:`PartAssembler` caches the sealed part of every
sub-batch, keyed by its requests, their rows and their resolution version, so a decode
iteration with an unchanged batch layout reuses last iteration's query tasks and only
builds the tails, spans and puts anew (plan once, run many).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tokenlake.core.plans import Batch, PutItem, QueryItem, QueryTask, RowSpan
from tokenlake.core.requests import NewTokenPut, RequestState


class Prepared(NamedTuple):
    """What ``gen_plans`` decided for one request before assembly (internal; a
    NamedTuple because it is built for every request of every iteration)."""

    prefix_tokens: int  # tokens the pool held for the request before this iteration
    state: RequestState
    tail: tuple[int, int, int] | None  # (instance, slot, valid tokens) of the open tail
    puts: tuple[NewTokenPut, ...]


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
    accesses: list  # (keys, per-instance reads) per request, for access accounting
    query_rows: dict[int, int]  # q rows this part sends to each instance
    put_rows: dict[int, int]  # KV rows this part stores on each instance


class PartAssembler:
    """Builds :class:`Part` objects; caches sealed query tasks across iterations."""

    def __init__(self) -> None:
        self._prev: dict = {}
        self._cur: dict = {}

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
        tails: dict[int, list[QueryItem]] = {}
        put_rows: dict[int, int] = {}
        tail_rows: dict[int, int] = {}  # q rows that only a tail (no sealed slot) draws there
        members = []
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
            if prep.tail is not None:
                inst, slot, n = prep.tail
                tails.setdefault(inst, []).append(QueryItem(rid, start, stop, (slot,), (n,)))
                if inst not in state.by_instance:  # q rows travel once per instance
                    tail_rows[inst] = tail_rows.get(inst, 0) + stop - start
            last = first + stop - start
            for put in prep.puts:
                pa = put.start if put.start > first else first
                pz = put.stop if put.stop < last else last
                if pa < pz:
                    puts.append(PutItem(put.instance, put.slot, put.offset + pa - put.start,
                                        start + pa - first, start + pz - first, put.key))
                    put_rows[put.instance] = put_rows.get(put.instance, 0) + pz - pa
        tasks, sealed_rows, accesses = self._sealed(members)
        query_rows = dict(sealed_rows)
        for inst, rows in tail_rows.items():
            query_rows[inst] = query_rows.get(inst, 0) + rows
        return Part(
            b, p, hi - lo, tuple(spans), tasks,
            tuple(QueryTask(i, tuple(items)) for i, items in sorted(tails.items())),
            tuple(puts), accesses, query_rows, put_rows,
        )

    def _sealed(self, members: list[tuple[RequestState, int, int]]):
        """Query tasks over sealed segments for ``(state, start, stop)`` members, cached."""
        key = tuple((s.request_id, s.version, start, stop) for s, start, stop in members)
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

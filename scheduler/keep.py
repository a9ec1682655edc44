"""Decode batches that stay together across decisions (docs/design.md §6).

The goodput DP of paper §6.2 is stateless: each decision batches every decode request
afresh, by context length, so one arrival (one more request in decode) can move every
decode request to another batch and another instance, where it waits for that batch to
start. On short chats, decode-bound, those waits are half of the time-between-token
misses (docs/evaluation.md, ShareGPT).

Here a running decode batch is a unit the DP keeps unless there is a reason not to:

* A decode request that ran on instance ``x`` in the last iteration
  (``RequestView.decode_instance``) stays in ``x``'s batch while that batch meets the
  smallest TBT SLO of its members. When grown contexts (or the pool's load) break it,
  members leave, longest context first, until the rest meet it; those leaving are
  batched afresh.
* A request new to decode joins the kept batch where it adds the least latency and the
  SLO still holds (as continuous batching adds a request to the running batch); what
  fits nowhere is batched by the DP over the remaining instances.
* When the kept batches leave the waiting prompts too few instances, the smallest kept
  batch is given up (its members join the others as new requests do, or are batched
  afresh), one at a time while the plan's total pays for the moves
  (``scheduler.goodput``: a move is charged about one TBT SLO, since the moved request
  waits for its new instance, often past its SLO); only with no kept batch left does
  the DP re-form everything, each batch then on the instance most of its members
  decoded on (:func:`placed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from scheduler.api import BatchDecision, RequestView, Snapshot
from scheduler.latency import SLO_RTOL, slowdown

#: ``keep`` (this module's rule) or ``reform`` (the stateless DP, every decision afresh)
DECODE_BATCH_RULES = ("keep", "reform")


def batch_time(snap: Snapshot, reqs: Sequence[RequestView]) -> float:
    """Seconds one decode iteration of ``reqs`` takes on one instance (the DP's model)."""
    lat = snap.latency
    work = sum(lat.c_new + lat.c_new_prefix * r.context_tokens + lat.c_new_sq
               + lat.c_prefix * r.context_tokens for r in reqs)
    return (work / lat.speedup(1) + lat.c_const + lat.c_request * len(reqs)) * slowdown(snap.cache_load)


def _slo(reqs: Sequence[RequestView]) -> float:
    return min((r.tbt_slo_s for r in reqs if r.tbt_slo_s is not None), default=float("inf"))


def _meets(snap: Snapshot, reqs: Sequence[RequestView], use_slo: bool) -> tuple[bool, float]:
    t = batch_time(snap, reqs)
    return (not use_slo or t <= _slo(reqs) * SLO_RTOL), t


@dataclass
class KeptDecode:
    """The decode batches kept from the last iteration and the requests left to batch.

    ``groups`` maps an instance to the members of its kept batch, in the DP's order;
    ``free`` are the decode requests batched afresh (in the DP's order); ``cost`` is the
    DP objective of the kept batches (members x iteration time, summed)."""

    groups: dict[int, list[RequestView]]
    free: list[RequestView]
    cost: float

    @classmethod
    def of(cls, snap: Snapshot, decode: list[RequestView], use_slo: bool,
           given_up: frozenset[int] = frozenset()) -> KeptDecode:
        """Keeps what may be kept of ``decode`` (ordered as the DP orders a phase); the
        batches of the ``given_up`` instances are not kept: their members join the kept
        ones as new requests do."""
        usable = {i.instance for i in snap.instances if not i.busy} - given_up
        groups: dict[int, list[RequestView]] = {}
        free: list[RequestView] = []
        for r in decode:
            if r.decode_instance in usable:
                groups.setdefault(r.decode_instance, []).append(r)
            else:
                free.append(r)
        times: dict[int, float] = {}
        for inst in list(groups):
            members = groups[inst]
            ok, t = _meets(snap, members, use_slo)
            while not ok:  # the SLO asks for a change: the longest contexts leave first
                free.append(members.pop(max(range(len(members)), key=lambda n: members[n].context_tokens)))
                ok, t = _meets(snap, members, use_slo) if members else (True, 0.0)
            if members:
                times[inst] = t
            else:
                del groups[inst]
        fresh = [r for r in free if r.decode_instance is None or r.decode_instance in given_up]
        for r in fresh:  # new to decode: into the kept batch where it adds the least
            best, where = float("inf"), None
            for inst, members in groups.items():
                ok, t = _meets(snap, [*members, r], use_slo)
                added = t * (len(members) + 1) - times[inst] * len(members)
                if ok and added < best:
                    best, where = added, inst
            if where is not None:
                groups[where].append(r)
                times[where] = batch_time(snap, groups[where])
                free.remove(r)
        order = {r.request_id: n for n, r in enumerate(decode)}
        for members in groups.values():
            members.sort(key=lambda r: order[r.request_id])
        free.sort(key=lambda r: order[r.request_id])
        cost = sum(times[i] * len(m) for i, m in groups.items())
        return cls(groups, free, cost)

    def batches(self) -> list[BatchDecision]:
        """The kept batches, each on its instance."""
        return [BatchDecision(tuple(r.request_id for r in members), "decode", 1,
                              (1,) * len(members), instance=inst)
                for inst, members in sorted(self.groups.items())]


def placed(snap: Snapshot, batches: Sequence[BatchDecision], views: dict[str, RequestView],
           taken: frozenset[int] = frozenset()) -> list[BatchDecision]:
    """Decode ``batches`` formed afresh, each on the instance most of its members decoded
    on (largest share first; each free instance, ``taken`` ones excepted, for one batch),
    so that as few requests as possible move; a batch none of whose members decoded on a
    free instance is left to the dispatch."""
    free = {i.instance for i in snap.instances if not i.busy} - taken
    claims = []  # (members that stay, batch index, instance)
    for n, b in enumerate(batches):
        came = [views[rid].decode_instance for rid in b.request_ids] if b.phase == "decode" else []
        for inst in set(came) - {None}:
            if inst in free:
                claims.append((came.count(inst), n, inst))
    where: dict[int, int] = {}
    for _, n, inst in sorted(claims, key=lambda c: (-c[0], c[1], c[2])):
        if n not in where and inst not in where.values():
            where[n] = inst
    return [replace(b, instance=where[n]) if n in where else b for n, b in enumerate(batches)]

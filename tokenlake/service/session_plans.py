"""What the control server does to a client session's plans and leases on their way
out: the session's request ids turned back into its own names, and the grants its
engines will check (:mod:`tokenlake.dataplane.grants`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tokenlake.core.plans import Batch, Plans, QueryItem, QueryPlan, QueryTask, RowSpan
from tokenlake.core.prefix_tree import SegmentLocation
from tokenlake.dataplane import grants
from tokenlake.dataplane.messages import RegisterQueryPlan, RegisterTransferPlan


def plan_grants(key: bytes, token: bytes, plans: Plans) -> tuple[tuple[bytes, bytes], ...]:
    """The grant of each sub-batch's query and transfer plan (as the session will
    register them) to session ``token``, under the cluster's grant ``key``."""
    gid = grants.plan_grant_id(plans.iteration)
    return tuple(
        (grants.sign(key, token, gid, grants.QUERY_PLAN,
                     grants.payload(RegisterQueryPlan.from_plan(0, qp).body())),
         grants.sign(key, token, gid, grants.TRANSFER_PLAN,
                     grants.payload(RegisterTransferPlan.from_plan(0, tp).body())))
        for qp, tp in zip(plans.query_plans, plans.transfer_plans))


def lease_grants(key: bytes, token: bytes, grant_id: int,
                 locations: Sequence[SegmentLocation]) -> tuple[tuple[int, bytes], ...]:
    """Per instance a lease reads, the grant to read exactly its leased slots there, in
    the order of ``locations`` (``READ_SEGMENT`` names them so)."""
    by_instance: dict[int, list[int]] = {}
    for loc in locations:
        by_instance.setdefault(loc.instance, []).append(loc.slot)
    return tuple((inst, grants.sign(key, token, grant_id, grants.READ, grants.payload({"slots": slots})))
                 for inst, slots in by_instance.items())


def renamed_batch(batch: Batch, prefix: str) -> Batch:
    """``batch`` with every request id in the session's namespace."""
    return Batch(tuple(dataclasses.replace(r, request_id=prefix + r.request_id)
                       for r in batch.requests), batch.phase)


def renamed_plans(plans: Plans, prefix: str) -> Plans:
    """``plans`` with the session's namespace taken off every request id (what the
    session sees is its own names)."""
    cut = len(prefix)

    def query(qp: QueryPlan) -> QueryPlan:
        def task(t: QueryTask) -> QueryTask:
            return QueryTask(t.instance, tuple(QueryItem(i.request_id[cut:], i.start, i.stop, i.slots, i.tokens)
                                               for i in t.items))
        spans = tuple(RowSpan(s.request_id[cut:], s.start, s.stop, s.position, s.prefix_tokens)
                      for s in qp.spans)
        return dataclasses.replace(qp, spans=spans, tasks=tuple(map(task, qp.tasks)),
                                   tails=tuple(map(task, qp.tails)))

    return dataclasses.replace(plans, query_plans=tuple(map(query, plans.query_plans)))

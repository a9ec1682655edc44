"""Thin adapter from a per-request router to :class:`scheduler.api.Policy`.

A router (:class:`CacheAwareRouter`, :class:`RoundRobinRouter`) pins each request to one
instance when it first appears; :meth:`RoutedPolicy.schedule` then forms at most one
batch per free pinned instance (DoP 1): its prefill requests if it has any (each computes
up to ``chunk_tokens`` of its remaining prompt, SGLang's prefill-first order), else its
decode requests. Requests that leave the snapshot are ``finish``-ed in the router.

``scheduler.api.Decision`` does not say which instance a batch runs on; the adapter keeps
that in :attr:`RoutedPolicy.placement` (``{request_id: instance}``) and
:meth:`batch_instances` for the caller or dispatcher to honour. Routing is memoised per
request id, so the same snapshot gives the same decision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler.api import BatchDecision, Decision, Snapshot


class RoutedPolicy:
    def __init__(self, router, token_ids: Callable[[str], Sequence[int]],
                 name: str = "routed", chunk_tokens: int = 8192) -> None:
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self.router = router
        self.token_ids = token_ids
        self.name = name
        self.chunk_tokens = chunk_tokens
        self.placement: dict[str, int] = {}

    def schedule(self, snap: Snapshot) -> Decision:
        live = {r.request_id for r in snap.requests}
        for rid in [rid for rid in self.placement if rid not in live]:
            self.router.finish(rid)
            del self.placement[rid]
        for r in sorted(snap.requests, key=lambda r: (r.arrival_s, r.request_id)):
            if r.request_id not in self.placement:
                self.placement[r.request_id] = self.router.route(
                    r.request_id, self.token_ids(r.request_id))
        free = {i.instance for i in snap.instances if not i.busy}
        batches = []
        for inst in sorted(free):
            mine = [r for r in snap.requests if self.placement[r.request_id] == inst]
            pre = [r for r in mine if r.phase == "prefill"]
            dec = [r for r in mine if r.phase == "decode"]
            if pre:
                batches.append(BatchDecision(
                    tuple(r.request_id for r in pre), "prefill", 1,
                    tuple(min(r.remaining_prefill, self.chunk_tokens) for r in pre)))
            elif dec:
                batches.append(BatchDecision(
                    tuple(r.request_id for r in dec), "decode", 1, (1,) * len(dec)))
        return Decision(tuple(batches), note=f"{self.name}: one batch per pinned instance")

    def batch_instances(self, decision: Decision) -> list[int]:
        """The instance each batch of ``decision`` is pinned to, in batch order."""
        return [self.placement[b.request_ids[0]] for b in decision.batches]

"""Continuous batching with a prefill token budget: the policy of a served pool whose one
compute engine runs every batch (``tokenlake serve`` on this machine).

Every iteration runs (at most) two batches on that engine, one after the other:

* a decode batch of every request that is decoding, so no running request waits;
* a prefill batch of up to ``chunk_tokens`` prompt tokens: the requests already
  prefilling first (in admission order), then the waiting ones in arrival order, each
  taking what is left of the budget (its last chunk may be partial).

A request that arrives while others decode is admitted in the very next iteration,
which is what keeps its time to first token short. The goodput DP
(:mod:`scheduler.goodput`) decides batches, phases and degrees of parallelism for
instances that compute in parallel; with one compute engine and one batch per
iteration it keeps a decode batch running to its end while new requests wait (measured
with ``tokenlake bench serve``), so the service uses this policy there. The baseline
engine (``tokenlake serve --engine reference``) batches the same way.
"""

from __future__ import annotations

from scheduler.api import BatchDecision, Decision, Snapshot


class ContinuousBatching:
    """See the module docstring. Needs two free instances when both batches run (the
    server's ``compute_slots``); with one, prefill goes first and decode next time."""

    name = "continuous"

    def __init__(self, chunk_tokens: int = 512) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens

    def schedule(self, snap: Snapshot) -> Decision:
        free = snap.free_instances
        batches: list[BatchDecision] = []
        budget = self.chunk_tokens
        ids, tokens = [], []
        queue = [r for r in snap.running if r.phase == "prefill"]
        queue += sorted(snap.waiting, key=lambda r: r.arrival_s)
        for r in queue:
            if budget < 1:
                break
            n = min(r.remaining_prefill, budget)
            ids.append(r.request_id)
            tokens.append(n)
            budget -= n
        if ids and free:
            batches.append(BatchDecision(tuple(ids), "prefill", 1, tuple(tokens)))
        decode = tuple(r.request_id for r in snap.running if r.phase == "decode")
        if decode and len(batches) < free:
            batches.append(BatchDecision(decode, "decode", 1, (1,) * len(decode)))
        return Decision(tuple(batches))
